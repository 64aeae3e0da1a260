"""Which version of the weights the actor side and each replica hold, as the manager saw its
delta-enabled syncs end: what decides whether a sync can send deltas."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from weightsync_core.delta import DeltaPlan

__all__ = ["DeltaLedger"]

_Replica = TypeVar("_Replica")


class DeltaLedger:
    """The manager's record of delta versions.

    A sync sends deltas against the actor side's version to the replicas that hold that
    version, and whole tensors to the others (a new or re-added replica, one whose last
    sync failed or was loaded another way): see :meth:`rounds`. Everyone gets whole tensors
    on the first sync, after a failed one, on a change of layout and every
    ``full_every``-th sync.
    The processes check the plan themselves too: a process asked to send or apply deltas
    against a version it does not hold (say, it restarted) fails the sync before applying
    anything, and the next sync is a full one.

    Args:
        full_every: make every Nth sync a whole copy for everyone (0: only when needed).
    """

    def __init__(self, full_every: int = 0) -> None:
        self.full_every = full_every
        self._actor_version: str | None = None
        self._replica_versions: dict[int, tuple[object, str]] = {}
        self._since_full = 0

    def holds(self, replica: object) -> str | None:
        """The version ``replica`` holds (None: none known)."""
        entry = self._replica_versions.get(id(replica))
        return entry[1] if entry is not None and entry[0] is replica else None

    def rounds(self, replicas: Sequence[_Replica], *, force_full: bool = False
               ) -> list[tuple[list[_Replica], DeltaPlan]]:
        """How a sync to ``replicas`` moves a new version (one fresh token): patches to the
        replicas that hold the actor side's version, then whole tensors to the rest; one
        round where all or none hold it. Patches go first: the actor side's copy is the base
        they are against until they have been sent."""
        full = DeltaPlan.new()
        base = self._actor_version
        due = self.full_every > 0 and self._since_full + 1 >= self.full_every
        if force_full or due or base is None:
            return [(list(replicas), full)]
        holders: list[_Replica] = []
        others: list[_Replica] = []
        for replica in replicas:
            (holders if self.holds(replica) == base else others).append(replica)
        delta = DeltaPlan(full.version, base)
        return [(group, plan) for group, plan in ((holders, delta), (others, full)) if group]

    def succeeded(self, rounds: Iterable[tuple[Iterable[object], DeltaPlan]]) -> None:
        """Record a sync that ended complete, by its :meth:`rounds`: the actor side and
        every replica hold its version."""
        rounds = list(rounds)
        patched = any(plan.is_delta for _, plan in rounds)
        self._since_full = self._since_full + 1 if patched else 0
        self._actor_version = rounds[0][1].version  # one version, however many rounds
        for replicas, plan in rounds:
            for replica in replicas:
                self._replica_versions[id(replica)] = (replica, plan.version)

    def failed(self, replicas: Iterable[object]) -> None:
        """Record a failed sync: neither the actor side nor ``replicas`` hold a known
        version any more (each may have changed part of its copy)."""
        self._actor_version = None
        self.forget(replicas)

    def forget(self, replicas: Iterable[object]) -> None:
        """``replicas`` hold no known version (removed, or loaded another way)."""
        for replica in replicas:
            self._replica_versions.pop(id(replica), None)
