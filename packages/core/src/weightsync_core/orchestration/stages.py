"""A weight sync's stages: run one after another under one deadline, each timed.

A stage is a set of concurrent calls, one per process (an actor rank, a rollout worker, a
replica). A stage that fails or runs past the deadline raises :class:`SyncStageError` or
:class:`SyncTimeoutError` naming the stage and the process to blame (see
:mod:`weightsync_core.orchestration.blame`), and the host it runs on when that is known.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import ray
import ray.exceptions

from weightsync_core.api.errors import SyncStageError, SyncTimeoutError, failed_stage
from weightsync_core.orchestration.blame import (
    Culprit,
    describe_exception,
    is_death,
    rank_failures,
    stalled_processes,
)

__all__ = ["Calls", "SyncStages"]

Calls = Sequence[tuple[str, Awaitable[Any]]]
"""One stage's calls: ``(process or replica name, awaitable)``."""

_GRACE_SECONDS = 2.0
"""How long the other processes of a failed stage may take to report their own failure."""
_PROBE_SECONDS = 1.0
"""How long a process may take to say what it is doing before it counts as frozen."""


class SyncStages:
    """Runs the stages of one sync (or one replica lifecycle call) under one deadline,
    ``timeout_seconds`` from now, and records how long each took in :attr:`metrics`
    (``weightsync/seconds/<stage>``: from the end of the previous stage, or from the start,
    to the end of this one; summed where a stage runs more than once).

    Args:
        backend: the backend's name, for error messages.
        timeout_seconds: the deadline of all stages together (``sync_timeout_seconds``).
        hosts: the host of each process by name; read when a stage fails, so it may be
            filled in as the sync goes (by the stage that asks every process where it runs).
    """

    def __init__(
        self, backend: str, timeout_seconds: float, hosts: Mapping[str, str] | None = None
    ) -> None:
        self.backend = backend
        self.timeout_seconds = timeout_seconds
        self.hosts: Mapping[str, str] = hosts if hosts is not None else {}
        self._loop = asyncio.get_running_loop()
        self.started = self._loop.time()
        self.deadline = self.started + timeout_seconds
        """When every stage must have finished (loop time)."""
        self.current = ""
        """The stage running, or the last one run."""
        self.metrics: dict[str, float] = {}
        """``weightsync/seconds/<stage>`` of every stage that finished."""
        self.peers: Mapping[str, str] | None = None
        """How the engines of the stages to come name each process to their peers
        (``"rollout rank 0"``) -> its name in the calls (``"rollout rank 2 (replica 1,
        worker 0)"``), where the two count differently (a round of a sync to some of the
        manager's replicas); None: a name in the calls starts with the engines' name."""
        self._stage_start = self.started

    def elapsed(self) -> float:
        """Seconds since these stages were set up."""
        return self._loop.time() - self.started

    async def run(
        self, name: str, calls: Callable[[], Calls],
        probe: Callable[[], Calls] | None = None, *, min_seconds: float = 0.0,
        members: Callable[[str], Calls] | None = None,
    ) -> list[Any]:
        """Run stage ``name``: start ``calls()`` and return their results in order.

        ``probe()`` asks the stage's processes what they are doing (``sync_progress``) when
        some fail or time out, so that the one that stopped making progress is blamed.
        ``min_seconds``: the stage may run this long even past the deadline (clean-up
        stages, so that a sync whose transfer finished is not failed by its clean-up).
        ``members(call name)``: for a call that failed because a process behind it died
        (a replica's, which goes to its workers), calls that ask each of those processes
        what it is doing, named as errors name them: the one that died is blamed, not the
        replica.

        Raises:
            SyncStageError: a call failed; names the process to blame.
            SyncTimeoutError: calls were still running at the deadline.
        """
        self.current = name
        deadline = max(self.deadline, self._loop.time() + min_seconds)
        results = await self._run_calls(name, calls(), deadline, probe, members)
        now = self._loop.time()
        key = f"weightsync/seconds/{name}"
        self.metrics[key] = self.metrics.get(key, 0.0) + now - self._stage_start
        self._stage_start = now
        return results

    def error(self, exc: BaseException, stage: str | None = None) -> SyncStageError:
        """``exc``, raised by the driver's own work during ``stage`` (default: the current
        one), as that stage's :class:`SyncStageError`."""
        stage = self.current if stage is None else stage
        return SyncStageError(
            f"weight sync ({self.backend}) failed at stage {stage!r}: "
            f"{type(exc).__name__}: {exc}", stage=stage,
        )

    def blame(self, stage: str, process: str, what: str) -> SyncStageError:
        """A failure of ``stage`` that the driver pins on ``process`` (``"rollout rank 1
        (replica 0, worker 1)"``), saying ``what`` it did; its host is named when known."""
        host = self.hosts.get(process)
        return SyncStageError(
            f"weight sync ({self.backend}) failed at stage {stage!r}: {process} {what}"
            + (f". {process} runs on host {host}" if host else ""),
            stage=stage, worker=process, host=host,
        )

    async def _run_calls(
        self, stage: str, calls: Calls, deadline: float, probe: Callable[[], Calls] | None,
        members: Callable[[str], Calls] | None = None,
    ) -> list[Any]:
        tasks = [asyncio.ensure_future(call) for _, call in calls]
        if not tasks:
            return []
        names = [name for name, _ in calls]
        done, _ = await asyncio.wait(
            tasks, timeout=self._left(deadline), return_when=asyncio.FIRST_EXCEPTION,
        )
        failed = [task for task in done if not task.cancelled() and task.exception()]
        pending = [task for task in tasks if not task.done()]
        if failed and pending:
            # give the other ranks a moment to report, so the root cause can be named
            await asyncio.wait(pending, timeout=min(_GRACE_SECONDS, self._left(deadline)))
        failures = [
            (name, exc) for name, task in zip(names, tasks, strict=True)
            if task.done() and not task.cancelled() and (exc := task.exception()) is not None
        ]
        pending_names = [name for name, task in zip(names, tasks, strict=True)
                         if not task.done()]
        stalled: list[Culprit] = []
        if pending_names and probe is not None:
            stalled = await _probe(pending_names, probe, failures, names, self.peers)
        if failures and members is not None:
            failures = await _name_the_dead(failures, members)
        _cancel([call for (_, call), task in zip(calls, tasks, strict=True)
                 if not task.done()], tasks)
        if failures:
            raise self._failure(stage, names, failures, stalled)
        if pending_names:
            raise self._timeout(stage, pending_names, stalled)
        return [task.result() for task in tasks]

    def _left(self, deadline: float) -> float:
        return max(deadline - self._loop.time(), 0.0)

    def _failure(
        self, stage: str, names: list[str], failures: list[tuple[str, BaseException]],
        stalled: list[Culprit],
    ) -> SyncStageError:
        """The error of a failed stage, its root cause in the headline."""
        culprit, reporter, exc = rank_failures(failures, names, stalled, self.peers)
        stage = failed_stage(exc) or stage  # a call of several stages says which one failed
        host = self.hosts.get(culprit.name)
        others = "; ".join(f"{other}: {describe_exception(e)}"
                           for other, e in failures if other != reporter)[:1200]
        if culprit.verdict == "failed":
            where = f"on {reporter}: "
        elif culprit.name == reporter:
            where = f"{culprit.name} {culprit.verdict}: "
        else:
            where = f"{culprit.name} {culprit.verdict} (reported by {reporter}): "
        return SyncStageError(
            f"weight sync ({self.backend}) failed at stage {stage!r} {where}"
            f"{describe_exception(exc)}" + (f". Also failed: {others}" if others else "")
            + (f". {culprit.name} runs on host {host}" if host else ""),
            stage=stage, worker=culprit.name, host=host,
        )

    def _timeout(
        self, stage: str, pending: list[str], stalled: list[Culprit]
    ) -> SyncTimeoutError:
        """The error of a stage whose ``pending`` processes did not finish in time."""
        blamed = stalled[0].name if stalled else None
        culprit = f"{blamed} {stalled[0].verdict}; " if stalled else ""
        host = self.hosts.get(blamed) if blamed else None
        return SyncTimeoutError(
            f"weight sync ({self.backend}) timed out at stage {stage!r} after "
            f"{self.timeout_seconds:.0f}s (sync_timeout_seconds): {culprit}"
            f"still waiting on: {', '.join(pending)}"
            + (f". {blamed} runs on host {host}" if host else ""),
            stage=stage, pending=pending, culprit=blamed, host=host,
        )


async def _probe(
    pending: list[str], probe: Callable[[], Calls],
    failures: list[tuple[str, BaseException]], names: list[str],
    peers: Mapping[str, str] | None = None,
) -> list[Culprit]:
    """Ask the ``pending`` processes what they are doing; a process that died is added to
    ``failures``, one that does not answer within :data:`_PROBE_SECONDS` counts as frozen."""
    asked = [(name, asyncio.ensure_future(call)) for name, call in probe() if name in pending]
    await asyncio.wait([task for _, task in asked], timeout=_PROBE_SECONDS)
    reports: dict[str, dict[str, Any] | None] = {}
    for name, task in asked:
        if not task.done():
            task.cancel()
            reports[name] = None
        elif task.cancelled() or task.exception() is not None:
            exc = task.exception() if not task.cancelled() else None
            if exc is not None and isinstance(exc, ray.exceptions.RayActorError):
                failures.append((name, exc))
            else:
                reports[name] = None
        else:
            reports[name] = task.result()
    return stalled_processes(reports, names, peers)


async def _name_the_dead(
    failures: list[tuple[str, BaseException]], members: Callable[[str], Calls]
) -> list[tuple[str, BaseException]]:
    """``failures`` with each call that failed because a process behind it died (a replica's
    call, which reached its workers) replaced by the processes behind it that are dead, as
    ``members(call name)`` names them: asked what they are doing, they fail within
    :data:`_PROBE_SECONDS` (Ray knows the process is gone). Where none is found dead (or the
    members cannot be asked), the call's own failure stays."""
    named: list[tuple[str, BaseException]] = []
    for name, exc in failures:
        dead: list[tuple[str, BaseException]] = []
        if is_death(exc):
            try:
                asked = [(member, asyncio.ensure_future(call)) for member, call in members(name)]
            except Exception:
                asked = []
            if asked:
                await asyncio.wait([task for _, task in asked], timeout=_PROBE_SECONDS)
            for member, task in asked:
                if not task.done():
                    task.cancel()
                elif not task.cancelled() and is_death(error := task.exception()):
                    dead.append((member, error))
        named += dead or [(name, exc)]
    return named


def _cancel(calls: list[Awaitable[Any]], tasks: Sequence[asyncio.Future]) -> None:
    """Cancel the Ray calls among ``calls`` and every task."""
    for call in calls:
        if isinstance(call, ray.ObjectRef):
            with contextlib.suppress(Exception):
                ray.cancel(call)
    for task in tasks:
        task.cancel()
