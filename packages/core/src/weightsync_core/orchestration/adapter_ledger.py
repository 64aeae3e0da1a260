"""The manager's record of LoRA adapter syncs: which versions of each adapter every replica
holds (a version counts once every worker of the replica took it), how many it keeps, and
each adapter's own delta ledger."""

from __future__ import annotations

from typing import Any

from weightsync_core.orchestration.delta_ledger import DeltaLedger

__all__ = ["AdapterLedger"]


class AdapterLedger:
    """Which versions of each adapter every managed replica serves.

    Args:
        keep: versions of each adapter a replica keeps (``config.adapter_versions``).
        delta: whether adapter syncs send patches against the version a replica holds
            (``config.delta``); each adapter then has its own :class:`DeltaLedger`.
        full_every: with ``delta``, every Nth adapter sync is a full one (0: only when
            needed).
    """

    def __init__(self, keep: int, delta: bool = False, full_every: int = 0) -> None:
        self.keep = keep
        self._delta = delta
        self._full_every = full_every
        self._held: dict[int, dict[str, list[int]]] = {}
        self._deltas: dict[str, DeltaLedger] = {}

    def held(self, replica: Any, name: str) -> list[int]:
        """The versions of adapter ``name`` ``replica`` serves, oldest first."""
        return list(self._held.get(id(replica), {}).get(name, []))

    def kept_after(self, replica: Any, name: str, version: int) -> list[int]:
        """The versions ``replica`` keeps once it took ``version``: the newest
        :attr:`keep` of those it held and ``version`` (a version it held again replaced)."""
        versions = [held for held in self.held(replica, name) if held != version]
        return [*versions, version][-self.keep:]

    def record(self, replica: Any, name: str, versions: list[int]) -> None:
        """``replica`` now serves exactly ``versions`` of adapter ``name``."""
        self._held.setdefault(id(replica), {})[name] = list(versions)

    def forget(self, replica: Any) -> None:
        """``replica`` is no longer managed."""
        self._held.pop(id(replica), None)

    def delta_ledger(self, name: str) -> DeltaLedger | None:
        """Adapter ``name``'s delta ledger, or None where adapter syncs are not
        delta-enabled."""
        if not self._delta:
            return None
        return self._deltas.setdefault(name, DeltaLedger(self._full_every))

    def status(self, named: list[tuple[str, Any]]) -> dict[str, dict[str, list[int]]]:
        """Per replica (``named``: each replica with the name to report it by): the versions
        of each adapter it serves."""
        return {label: {name: list(versions)
                        for name, versions in self._held.get(id(replica), {}).items()}
                for label, replica in named}
