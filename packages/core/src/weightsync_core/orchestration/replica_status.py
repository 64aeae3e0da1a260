"""What a replica serves, has staged and could roll back to, from its workers' own
reports (:meth:`~weightsync_core.worker.rollout.CheckpointEngineWorker.weights_status`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

__all__ = ["replica_status", "worker_status"]


async def worker_status(worker: Any, timeout_seconds: float) -> dict[str, Any] | None:
    """``worker``'s ``weights_status()``, or None where it does not answer within
    ``timeout_seconds`` (it died, or is frozen) or has no such call (verl's workers)."""
    call = getattr(worker, "weights_status", None)
    if call is None:
        return None
    try:
        return await asyncio.wait_for(_awaited(call.remote()), timeout_seconds)
    except Exception:
        return None


async def _awaited(ref: Any) -> Any:
    return await ref


def _agreed(workers: Sequence[dict[str, Any] | None], key: str) -> Any:
    """The value of ``key`` every worker reports, or None where they differ (or one did not
    answer)."""
    values = {None if status is None else status.get(key) for status in workers}
    return values.pop() if len(values) == 1 else None


def replica_status(workers: Sequence[dict[str, Any] | None], stale: bool) -> dict[str, Any]:
    """One replica's status from its workers' (see
    :meth:`~weightsync_core.orchestration.manager.CheckpointEngineManager.weights_status`);
    ``stale``: the manager lists it in ``stale_replicas``."""
    whole = bool(workers) and all(status is not None and status.get("complete")
                                  for status in workers)
    version = _agreed(workers, "version")
    staged = _agreed(workers, "staged_version")
    if stale:
        state = "stale"
    elif not whole or len({None if s is None else s.get("version") for s in workers}) > 1:
        state = "mixed"
    elif staged is not None:
        state = "staged"
    else:
        state = "serving"
    return {"state": state, "version": version if whole else None, "staged_version": staged,
            "rollback_version": _agreed(workers, "rollback_version"),
            "workers": list(workers)}
