"""Phase 2 of a staged sync: each replica paused, its workers' stages handed to the server,
resumed; a replica where a server failed to take its stage is rolled back (every worker of
it: a replica serves one version) and resumed on the version it served, or, where a worker
could not roll back (or died), left paused and reported stale."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync_core.api.protocols import RolloutReplica
from weightsync_core.orchestration.replica_status import worker_status

__all__ = ["ReplicaCommit", "commit_replica", "switches_whole"]

_SWITCH_REPORT_SECONDS = 5.0
"""How long past the deadline a one-worker switch may take to report that it gave up."""


@dataclass
class ReplicaCommit:
    """How one replica's commit ended.

    Attributes:
        replica: the replica.
        failures: ``(worker name, error)`` of each worker whose server failed to take its
            stage (empty: the replica serves the new version).
        serving: whether the replica serves after the commit (the new version, or, after a
            failure, the one it served before: every worker rolled back).
        paused_seconds: how long the replica was paused.
    """

    replica: RolloutReplica
    failures: list[tuple[str, BaseException]] = field(default_factory=list)
    serving: bool = True
    paused_seconds: float = 0.0


async def commit_replica(
    replica: RolloutReplica, worker_names: Sequence[str], timeout_seconds: float,
    pause: Callable[[RolloutReplica], Awaitable[None]],
    resume: Callable[[RolloutReplica], Awaitable[None]],
    switch_mode: str | None = None, replica_name: str = "the replica",
) -> ReplicaCommit:
    """Pause ``replica`` (``pause``), commit every worker's stage (``commit_staged``, at
    once, within ``timeout_seconds``), and resume it (``resume``) unless a worker is left
    holding a mix of versions (it reports ``complete`` False, or does not answer). A worker
    that fails rolls its own server back (:meth:`CheckpointEngineWorker.commit_staged`), and
    the replica's workers that took theirs roll back too (``roll_back_commit``). A replica
    of one worker, given ``switch_mode``, does all three in one call to it
    (``switch_to_staged(switch_mode)``: its pause covers only its own work, no round trip
    to the manager); so does a replica that switches as a whole (:func:`switches_whole`).
    A pause that fails or runs past ``timeout_seconds`` commits nothing: the replica is
    resumed on its version (named ``replica_name`` in the failure)."""
    outcome = ReplicaCommit(replica)
    workers = list(replica.workers)
    if switches_whole(replica):
        return await _switch_whole(outcome, worker_names, timeout_seconds,
                                   switch_mode or "keep")
    if switch_mode is not None and len(workers) == 1 and hasattr(workers[0],
                                                                  "switch_to_staged"):
        return await _switch_alone(outcome, workers[0], worker_names[0], timeout_seconds,
                                   switch_mode)
    start = time.monotonic()
    try:
        await asyncio.wait_for(pause(replica), timeout_seconds)
    except Exception as error:
        return await _resume_unchanged(outcome, replica_name, error, resume, timeout_seconds,
                                       start)
    calls = [asyncio.wait_for(_awaited(worker.commit_staged.remote()), timeout_seconds)
             for worker in workers]
    results = await asyncio.gather(*calls, return_exceptions=True)
    outcome.failures = [(name, result) for name, result in zip(worker_names, results, strict=True)
                        if isinstance(result, BaseException)]
    if outcome.failures:  # the workers that took theirs go back too: one version per replica
        took = [worker for worker, result in zip(workers, results, strict=True)
                if not isinstance(result, BaseException)]
        await asyncio.gather(*(asyncio.wait_for(_awaited(worker.roll_back_commit.remote()),
                                                timeout_seconds) for worker in took),
                             return_exceptions=True)
        statuses = await asyncio.gather(*(worker_status(worker, timeout_seconds)
                                          for worker in workers))
        outcome.serving = all(status is not None and status.get("complete")
                              for status in statuses)
    if outcome.serving:
        await asyncio.wait_for(resume(replica), timeout_seconds)
    outcome.paused_seconds = time.monotonic() - start
    if not outcome.failures:  # every worker took its stage: no roll-back needs the old one
        await asyncio.gather(*(_awaited(worker.forget_replaced.remote()) for worker in workers
                               if hasattr(worker, "forget_replaced")), return_exceptions=True)
    return outcome


async def _resume_unchanged(
    outcome: ReplicaCommit, replica_name: str, error: Exception,
    resume: Callable[[RolloutReplica], Awaitable[None]], timeout_seconds: float, start: float,
) -> ReplicaCommit:
    """A replica whose pause failed: nothing was committed; drop its workers' stages and
    resume it on its version (it serves where that works and every worker is whole)."""
    outcome.failures = [(f"{replica_name} (pausing it for the switch)", error)]
    workers = outcome.replica.workers
    await asyncio.gather(*(asyncio.wait_for(_awaited(worker.discard_staged.remote()),
                                            timeout_seconds) for worker in workers),
                         return_exceptions=True)
    try:
        await asyncio.wait_for(resume(outcome.replica), timeout_seconds)
    except Exception:
        outcome.serving = False
    else:
        statuses = await asyncio.gather(*(worker_status(worker, timeout_seconds)
                                          for worker in workers))
        outcome.serving = all(status is not None and status.get("complete")
                              for status in statuses)
    outcome.paused_seconds = time.monotonic() - start
    return outcome


async def _awaited(call: Awaitable[Any]) -> Any:
    return await call


async def _switch_alone(outcome: ReplicaCommit, worker: Any, name: str, timeout_seconds: float,
                        mode: str) -> ReplicaCommit:
    """:func:`commit_replica` of a replica of one worker: one ``switch_to_staged`` call."""
    try:
        # the worker gives its switch up at the deadline itself (and resumes on its version);
        # the extra seconds let it say so before this call is abandoned
        result = await asyncio.wait_for(
            _awaited(worker.switch_to_staged.remote(mode, timeout_seconds)),
            timeout_seconds + _SWITCH_REPORT_SECONDS)
        outcome.paused_seconds = float(result["paused_seconds"])
    except Exception as error:
        outcome.failures = [(name, error)]
        status = await worker_status(worker, timeout_seconds)
        outcome.serving = status is not None and bool(status.get("complete"))
    return outcome


def switches_whole(replica: RolloutReplica) -> bool:
    """Whether ``replica`` switches to its stage as a whole, in one call of its own
    (``switch_to_staged``, ``discard_staged``: see
    :class:`~weightsync_core.api.protocols.RolloutReplica`)."""
    return hasattr(replica, "switch_to_staged") and hasattr(replica, "discard_staged")


async def _switch_whole(outcome: ReplicaCommit, worker_names: Sequence[str],
                        timeout_seconds: float, mode: str) -> ReplicaCommit:
    """:func:`commit_replica` of a replica that switches as a whole: one call to it; after
    a failure it serves where every worker reports a whole version."""
    replica: Any = outcome.replica
    try:
        result = await asyncio.wait_for(replica.switch_to_staged(mode, timeout_seconds),
                                        timeout_seconds + _SWITCH_REPORT_SECONDS)
        outcome.paused_seconds = float(result["paused_seconds"])
    except Exception as error:
        statuses = await asyncio.gather(*(worker_status(worker, timeout_seconds)
                                          for worker in replica.workers))
        outcome.failures = [(worker_names[0], error)]
        outcome.serving = all(status is not None and status.get("complete")
                              for status in statuses)
    return outcome
