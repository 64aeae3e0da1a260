"""Which replicas of a delta-enabled sync get patches: decided from the versions the
processes themselves report holding, and the manager's own record of full syncs and
failures."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from weightsync_core.data.delta import DeltaPlan

__all__ = ["DeltaLedger"]

_Replica = TypeVar("_Replica")


class DeltaLedger:
    """The manager's record of delta syncs.

    A sync sends deltas against the version the actor side holds to the replicas all of
    whose workers hold that version, and whole tensors to the others: see :meth:`rounds`,
    which is given what each process reports holding (so a sync of another manager, a
    replica loaded another way or a restarted process leads to whole tensors where needed,
    never to a failed sync). Everyone gets whole tensors where the actor side holds no
    version, after a failed sync, on a change of layout and every ``full_every``-th sync.
    The processes check the plan themselves too: a process asked to send or apply deltas
    against a version it does not hold fails the sync before applying anything.

    Args:
        full_every: make every Nth sync a whole copy for everyone (0: only when needed).
    """

    def __init__(self, full_every: int = 0) -> None:
        self.full_every = full_every
        self._since_full = 0
        self._last_failed = False

    def rounds(self, replicas: Sequence[_Replica], actor_version: str | None,
               held: Sequence[Sequence[str | None]], *, force_full: bool = False
               ) -> list[tuple[list[_Replica], DeltaPlan]]:
        """How a sync to ``replicas`` moves a new version (one fresh token): patches to the
        replicas that hold ``actor_version`` (the actor side's, as its sending rank
        reports it; None: none), then whole tensors to the rest; one round where all or
        none hold it. ``held[i]``: the version each worker of ``replicas[i]`` reports (None:
        none, or it could not say). Patches go first: the actor side's copy is the base they
        are against until they have been sent."""
        if len(held) != len(replicas):
            raise ValueError(f"rounds: {len(held)} replicas' reported versions for "
                             f"{len(replicas)} replicas; pass one list per replica")
        full = DeltaPlan.new()
        due = self.full_every > 0 and self._since_full + 1 >= self.full_every
        if force_full or due or self._last_failed or actor_version is None:
            return [(list(replicas), full)]
        holders: list[_Replica] = []
        others: list[_Replica] = []
        for replica, versions in zip(replicas, held, strict=True):
            holds = bool(versions) and all(version == actor_version for version in versions)
            (holders if holds else others).append(replica)
        delta = DeltaPlan(full.version, actor_version)
        return [(group, plan) for group, plan in ((holders, delta), (others, full)) if group]

    def succeeded(self, rounds: Iterable[tuple[Iterable[object], DeltaPlan]]) -> None:
        """Record a sync that ended complete, by its :meth:`rounds` (as they ran: a round of
        patches that fell back to whole tensors counts as whole)."""
        patched = any(plan.is_delta for _, plan in rounds)
        self._since_full = self._since_full + 1 if patched else 0
        self._last_failed = False

    def failed(self) -> None:
        """Record a failed sync: the next one sends whole tensors to everyone (a process may
        have changed part of its copy)."""
        self._last_failed = True
