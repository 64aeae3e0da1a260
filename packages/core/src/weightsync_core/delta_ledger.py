"""Which version of the weights the actor side and each replica hold, as the manager saw its
delta-enabled syncs end: what decides whether a sync can send deltas."""

from __future__ import annotations

from collections.abc import Iterable

from weightsync_core.delta import DeltaPlan

__all__ = ["DeltaLedger"]


class DeltaLedger:
    """The manager's record of delta versions.

    A sync sends deltas against the actor side's version only when every replica in it
    holds that version; otherwise (a new or re-added replica, one whose last sync failed,
    the first sync, a change of layout, every ``full_every``-th sync) it is a full one.
    The processes check the plan themselves too: a process asked to send or apply deltas
    against a version it does not hold (say, it restarted) fails the sync before applying
    anything, and the next sync is a full one.

    Args:
        full_every: make every Nth sync full (0: only when needed).
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

    def plan(self, replicas: Iterable[object], *, force_full: bool = False) -> DeltaPlan:
        """The plan of a sync to ``replicas``: a new version's token, and the base its
        deltas are against (None: a full sync)."""
        base = self._actor_version
        due = self.full_every > 0 and self._since_full + 1 >= self.full_every
        if force_full or due or base is None or any(self.holds(r) != base for r in replicas):
            return DeltaPlan.new()
        return DeltaPlan.new(base)

    def succeeded(self, replicas: Iterable[object], plan: DeltaPlan) -> None:
        """Record a sync that ended complete: the actor side and ``replicas`` hold its
        version."""
        self._actor_version = plan.version
        self._since_full = self._since_full + 1 if plan.is_delta else 0
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
