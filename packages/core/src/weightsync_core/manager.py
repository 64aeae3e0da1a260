"""The manager that runs one weight sync from ``actor_wg`` to every rollout replica."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import itertools
import logging
import sys
import types
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

import ray

from weightsync_core.base import CheckpointEngineWithCache
from weightsync_core.blame import (
    Culprit,
    describe_exception,
    rank_failures,
    stalled_processes,
)
from weightsync_core.blocking import retrieve_exception
from weightsync_core.config import CheckpointEngineConfig
from weightsync_core.errors import SyncStageError, SyncTimeoutError
from weightsync_core.plugins import load_custom_backend_module
from weightsync_core.protocols import CheckpointEngineWorkerGroup, RolloutReplica
from weightsync_core.ray_group import RayWorkerGroup
from weightsync_core.registry import CheckpointEngineRegistry
from weightsync_core.wire import new_session_key

__all__ = ["CheckpointEngineManager", "awaitable_or_blocking", "run_sync"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

Calls = Sequence[tuple[str, Awaitable[Any]]]
"""One stage's calls: ``(process or replica name, awaitable)``."""

_CLEANUP_SECONDS = 10.0
"""How long the next sync waits for the clean-up calls a failed sync left running."""
_CLEANUP_GRACE_SECONDS = 0.2
"""How long a failing sync waits for its clean-up calls before it raises."""
_GRACE_SECONDS = 2.0
_PROBE_SECONDS = 1.0
"""How long a process may take to say what it is doing before it counts as frozen."""
_TRANSFER_STAGES = frozenset({"transfer", "finalize"})


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` from synchronous code (in a helper thread if a loop is running)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


_ANONYMOUS_FRAMES = frozenset({"<lambda>", "<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>"})
_ASYNC_FLAGS = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def _called_from_async_code(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` (a caller) is a coroutine, looking through lambdas and
    comprehensions to the function that wrote them."""
    while frame is not None and frame.f_code.co_name in _ANONYMOUS_FRAMES:
        frame = frame.f_back
    return frame is not None and bool(frame.f_code.co_flags & _ASYNC_FLAGS)


def awaitable_or_blocking(
    method: Callable[..., Coroutine[Any, Any, T]],
) -> Callable[..., Any]:
    """Make an ``async`` method callable the way verl's trainer code calls its manager: from
    a coroutine it returns the coroutine to await; from synchronous code it runs it to the
    end and returns the result (in a helper thread when the thread already runs an event
    loop), so a call is never a silently dropped coroutine."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        coroutine = method(*args, **kwargs)
        if _called_from_async_code(sys._getframe(1)):
            return coroutine
        return run_sync(coroutine)

    return call


class _StageRunner:
    """Runs one sync's stages one after another under the sync's deadline, timing each."""

    def __init__(self, manager: CheckpointEngineManager, deadline: float) -> None:
        self.manager = manager
        self.deadline = deadline
        self.current = "abort_requests"
        self.metrics: dict[str, float] = {}
        self._loop = asyncio.get_running_loop()
        self._stage_start = self._loop.time()

    async def run(
        self, name: str, calls: Callable[[], Calls],
        probe: Callable[[], Calls] | None = None, own_budget: bool = False,
    ) -> list[Any]:
        """Run stage ``name``; ``probe`` asks its processes what they are doing if it fails
        or times out. ``own_budget`` stages may outlive the deadline a little, so that a
        sync whose transfer finished is not failed by its clean-up."""
        self.current = name
        deadline = self.deadline
        if own_budget:
            deadline = max(deadline, self._loop.time() + _CLEANUP_SECONDS)
        results = await self.manager._run_stage(name, calls(), deadline, probe)
        now = self._loop.time()
        self.metrics[f"weightsync/seconds/{name}"] = now - self._stage_start
        self._stage_start = now
        return results


class CheckpointEngineManager:
    """Coordinates weight syncs between ``actor_wg`` and a set of rollout replicas.

    One sync: abort in-flight requests, release KV cache, prepare, build topology, init
    process groups, send and receive, finalize, resume generation. Every stage awaits Ray
    object refs (no blocking ``ray.get``) under one deadline of
    ``config.sync_timeout_seconds``; a failure raises :class:`SyncStageError` (or
    :class:`SyncTimeoutError`) naming the stage and the worker.

    If a sync fails after bytes started moving, its replicas are left paused (not resumed)
    and listed in :attr:`stale_replicas` until a later sync succeeds or they are removed.

    Args:
        config: the checkpoint-engine configuration.
        actor_wg: the training-side worker group (a :class:`CheckpointEngineWorkerGroup`).
        replicas: the rollout replicas (:class:`RolloutReplica`).
    """

    def __init__(
        self,
        config: CheckpointEngineConfig,
        actor_wg: CheckpointEngineWorkerGroup,
        replicas: Iterable[RolloutReplica] = (),
    ) -> None:
        self.config = config
        load_custom_backend_module(config.custom_backend_module)
        self.backend_cls = CheckpointEngineRegistry.get(config.backend)
        self.backend_cls.check_options(config.active_engine_kwargs, config.backend)
        self.actor_wg = actor_wg
        self.replicas: list[RolloutReplica] = []
        self.stale_replicas: list[RolloutReplica] = []
        self._addresses: dict[str, str] = {}
        """Host address of each process and replica (by name) as of the last sync; cleared
        when replicas are added or removed."""
        self._cleanup: list[ray.ObjectRef] = []
        self.add_replicas(replicas)

    @property
    def backend(self) -> str:
        """The configured backend name."""
        return self.config.backend

    def add_replicas(self, replicas: Iterable[RolloutReplica]) -> None:
        """Include ``replicas`` from the next sync on."""
        for replica in replicas:
            if any(replica is known for known in self.replicas):
                raise ValueError(f"replica {replica!r} is already managed")
            self.replicas.append(replica)
        self._addresses = {}  # rollout ranks are renumbered

    def remove_replicas(self, replicas: Iterable[RolloutReplica]) -> None:
        """Stop syncing ``replicas`` (e.g. after one failed); the others are untouched."""
        for replica in replicas:
            if not any(replica is known for known in self.replicas):
                raise ValueError(f"replica {replica!r} is not managed by this manager")
            self.replicas = [known for known in self.replicas if known is not replica]
            self.stale_replicas = [known for known in self.stale_replicas if known is not replica]
        self._addresses = {}  # rollout ranks are renumbered

    def rollout_group(self, workers: list[Any]) -> CheckpointEngineWorkerGroup:
        """The worker group a sync drives on the rollout side, from the replicas' workers
        (a :class:`RayWorkerGroup`; override for workers with other calling conventions,
        as ``weightsync-verl`` does for verl's)."""
        return RayWorkerGroup(workers)

    @awaitable_or_blocking
    async def sleep_replicas(self) -> None:
        """Put every replica to sleep (free weight and KV-cache memory); replicas must
        implement ``sleep()``, as verl's do."""
        await self._lifecycle("sleep_replicas", "sleep")

    @awaitable_or_blocking
    async def wake_up_replicas(self) -> None:
        """Wake every replica (restore weight and KV-cache memory); replicas must implement
        ``wake_up()``, as verl's do."""
        await self._lifecycle("wake_up_replicas", "wake_up")

    @awaitable_or_blocking
    async def abort_replicas(self, reject_request: bool = False) -> None:
        """Stop in-flight generation on every replica. ``reject_request``: fail requests
        that arrive until :meth:`resume_generation_replicas` instead of parking them (passed
        to replicas only when set, as verl's replicas take it)."""
        options = {"reject_request": True} if reject_request else {}
        await self._lifecycle("abort_replicas", "abort_all_requests", **options)

    @awaitable_or_blocking
    async def resume_generation_replicas(self) -> None:
        """Let every replica serve again."""
        await self._lifecycle("resume_generation_replicas", "resume_generation")

    @awaitable_or_blocking
    async def release_kv_cache_replicas(self) -> None:
        """Free every replica's KV cache, keeping its weights (a sync does this itself)."""
        await self._lifecycle("release_kv_cache_replicas", "release_kv_cache")

    @awaitable_or_blocking
    async def resume_kv_cache_replicas(self) -> None:
        """Restore every replica's KV cache (a sync does this itself after the transfer)."""
        await self._lifecycle("resume_kv_cache_replicas", "resume_kv_cache")

    async def _lifecycle(self, stage: str, method: str, **options: Any) -> None:
        """Call ``method`` on every replica at once, within ``sync_timeout_seconds``; a
        failure names the replica."""
        missing = sorted({type(r).__name__ for r in self.replicas if not hasattr(r, method)})
        if missing:
            raise TypeError(
                f"{stage}: replica class(es) {', '.join(missing)} have no {method}() method; "
                f"implement it to use {stage}"
            )
        deadline = asyncio.get_running_loop().time() + self.config.sync_timeout_seconds
        calls = [(f"replica {index}", getattr(replica, method)(**options))
                 for index, replica in enumerate(self.replicas)]
        await self._run_stage(stage, calls, deadline)

    def update_weights_sync(
        self, global_steps: int | None = None, *, allow_manifest_change: bool = False
    ) -> dict[str, float]:
        """:meth:`update_weights` for synchronous callers."""
        return run_sync(self._update_weights(global_steps, allow_manifest_change))

    @awaitable_or_blocking
    async def update_weights(
        self, global_steps: int | None = None, *, allow_manifest_change: bool = False
    ) -> dict[str, float]:
        """Move the actor's current weights to every replica; return metrics. Await it from
        async code; called from synchronous code it runs the sync and returns the metrics
        (as verl's trainer calls ``checkpoint_manager.update_weights(global_steps)``).

        A sync that delivers no tensors fails, and so does one whose tensor names, shapes or
        dtypes differ from what a replica loaded in its previous sync (it is refused before
        the changed tensor is loaded), unless ``allow_manifest_change`` says the model's
        layout changed on purpose.

        Metrics (``weightsync/`` prefix): ``bytes`` (payload: one copy of the weights),
        ``tensors``, ``buckets``, ``seconds/<stage>``, ``seconds/total``, ``transfer_gbps``
        and ``gbps`` (payload bytes per second).
        """
        return await self._update_weights(global_steps, allow_manifest_change)

    async def _update_weights(
        self, global_steps: int | None, allow_manifest_change: bool
    ) -> dict[str, float]:
        return await self._sync(list(self.replicas), global_steps, False, allow_manifest_change)

    def update_replicas_from_cache_sync(
        self, replicas: Iterable[RolloutReplica], global_steps: int | None = None
    ) -> dict[str, float]:
        """:meth:`update_replicas_from_cache` for synchronous callers."""
        return run_sync(self._update_replicas_from_cache(replicas, global_steps))

    @awaitable_or_blocking
    async def update_replicas_from_cache(
        self, replicas: Iterable[RolloutReplica], global_steps: int | None = None
    ) -> dict[str, float]:
        """Bring managed ``replicas`` (e.g. just added) to the latest update from the actor
        side's cache, without the actor ranks sending again (backends with a cache, such as
        ``kimi``). ``global_steps`` is the version to report (that of the last update).
        Metrics as :meth:`update_weights`; ``bytes`` is what the replicas loaded. Awaitable,
        or run to the end from synchronous code, like :meth:`update_weights`."""
        return await self._update_replicas_from_cache(replicas, global_steps)

    async def _update_replicas_from_cache(
        self, replicas: Iterable[RolloutReplica], global_steps: int | None
    ) -> dict[str, float]:
        if not issubclass(self.backend_cls, CheckpointEngineWithCache):
            raise TypeError(
                f"backend {self.backend!r} keeps no cache of the latest weights on the actor "
                "side; new replicas get the weights from the next update_weights"
            )
        chosen = list(replicas)
        for replica in chosen:
            if not any(replica is known for known in self.replicas):
                raise ValueError(f"replica {replica!r} is not managed; add_replicas() first")
        return await self._sync(chosen, global_steps, True, False)

    async def _sync(
        self, replicas: list[RolloutReplica], global_steps: int | None, from_cache: bool,
        allow_manifest_change: bool,
    ) -> dict[str, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        stages = _StageRunner(self, started + self.config.sync_timeout_seconds)
        await self._settle_cleanup(self.config.sync_timeout_seconds / 2)
        # a colocated engine (naive) hands the weights over inside each actor process, which
        # also serves generation: as in verl, the replicas are not paused around it
        lifecycle = replicas if not self.backend_cls.is_colocated else []
        try:
            for name, method in (("abort_requests", "abort_all_requests"),
                                 ("release_kv_cache", "release_kv_cache")):
                await stages.run(name, functools.partial(self._replica_calls, lifecycle, method))
            sent = await self._transfer(
                stages, replicas, global_steps, from_cache, allow_manifest_change
            )
        except BaseException as exc:
            error = exc if isinstance(exc, SyncStageError) else SyncStageError(
                f"weight sync ({self.backend}) failed at stage {stages.current!r}: "
                f"{type(exc).__name__}: {exc}", stage=stages.current,
            )
            await asyncio.shield(self._recover(error, replicas))
            if error is exc or isinstance(exc, asyncio.CancelledError):
                raise
            raise error from exc
        self.stale_replicas = [
            stale for stale in self.stale_replicas if not any(stale is r for r in replicas)
        ]
        for name in ("resume_kv_cache", "resume_generation"):
            await stages.run(name, functools.partial(self._replica_calls, lifecycle, name),
                             own_budget=True)

        metrics = stages.metrics
        total = loop.time() - started
        nbytes = max((result.get("nbytes", 0) for result in sent), default=0)
        transfer_seconds = metrics.get("weightsync/seconds/transfer", 0.0)
        metrics.update({
            "weightsync/bytes": float(nbytes),
            "weightsync/tensors": float(max((r.get("num_tensors", 0) for r in sent), default=0)),
            "weightsync/buckets": float(max((r.get("num_buckets", 0) for r in sent), default=0)),
            "weightsync/replicas": float(len(replicas)),
            "weightsync/seconds/total": total,
            "weightsync/transfer_gbps": (
                nbytes / transfer_seconds / 1e9 if transfer_seconds else 0.0
            ),
            "weightsync/gbps": nbytes / total / 1e9 if total else 0.0,
        })
        return metrics

    async def _transfer(
        self, stages: _StageRunner, replicas: list[RolloutReplica], global_steps: int | None,
        from_cache: bool, allow_manifest_change: bool,
    ) -> list[dict[str, Any]]:
        actor_wg = self.actor_wg
        actor_names = [f"actor_wg rank {rank}" for rank in range(actor_wg.world_size)]
        manifest_option = {"allow_manifest_change": True} if allow_manifest_change else {}
        if self.backend_cls.is_colocated:
            sent = await stages.run("transfer", lambda: list(zip(
                actor_names, actor_wg.update_weights(global_steps, **manifest_option),
                strict=True,
            )))
            return self._nonempty(sent, stages)
        workers = [worker for replica in replicas for worker in replica.workers]
        if not workers:
            raise SyncStageError(
                f"backend {self.backend!r} moves weights to rollout workers, but the manager "
                "has no replicas; add_replicas() first", stage="prepare",
            )
        rollout = self.rollout_group(workers)
        rollout_names = [
            f"rollout rank {rank} (replica {index}, worker {local})"
            for rank, (index, local) in enumerate(
                (index, local) for index, replica in enumerate(replicas)
                for local in range(len(replica.workers))
            )
        ]
        names = actor_names + rollout_names

        def both(method: str, actor_kwargs=None, rollout_kwargs=None) -> Callable[[], Calls]:
            def calls() -> Calls:
                refs = actor_wg.execute_checkpoint_engine(method, **(actor_kwargs or {}))
                refs += rollout.execute_checkpoint_engine(method, **(rollout_kwargs or {}))
                return list(zip(names, refs, strict=True))
            return calls

        progress = both("sync_progress")
        key = new_session_key()  # this sync's secret, handed to every process through Ray
        await stages.run("authenticate", both(
            "set_session_key", {"key": [key] * actor_wg.world_size},
            {"key": [key] * rollout.world_size},
        ), progress)
        # where each process runs, so that a failure names the host (a cable, a switch)
        self._addresses = dict(zip(names, await stages.run("locate", both("address")),
                                   strict=True))
        first_workers = itertools.accumulate([0, *(len(r.workers) for r in replicas[:-1])])
        self._addresses.update({  # a replica's stages (abort, resume) blame the replica
            f"replica {index}": self._addresses[rollout_names[first]]
            for index, first in enumerate(first_workers)
        })
        metadata = await stages.run("prepare", both("prepare"), progress)
        try:
            actor_kwargs, rollout_kwargs = self.backend_cls.build_replica_topology(
                actor_wg.world_size, [len(replica.workers) for replica in replicas], metadata
            )
            # engines written for verl may name the method too (verl's manager overwrites it)
            actor_kwargs.pop("method", None)
            rollout_kwargs.pop("method", None)
        except Exception as exc:
            raise SyncStageError(
                f"weight sync ({self.backend}) failed at stage 'build_topology': "
                f"{type(exc).__name__}: {exc}", stage="build_topology",
            ) from exc
        await stages.run(
            "init_process_group", both("init_process_group", actor_kwargs, rollout_kwargs),
            progress,
        )
        if from_cache:  # the actor ranks send nothing: the rollout workers pull the cache
            results = await stages.run("transfer", lambda: list(zip(
                rollout_names, rollout.update_weights_from_cache(global_steps), strict=True
            )), progress)
        else:
            results = await stages.run("transfer", lambda: list(zip(
                names,
                actor_wg.update_weights(global_steps, **manifest_option)
                + rollout.update_weights(global_steps, **manifest_option),
                strict=True,
            )), progress)
        await stages.run("finalize", both("finalize"), progress)
        # payload per receiver: the senders' counts, or (from the cache) what a worker loaded
        sent = results[: actor_wg.world_size] if not from_cache else results[:1]
        return self._nonempty(sent, stages)

    def _nonempty(self, sent: list[dict[str, Any]], stages: _StageRunner) -> list[dict[str, Any]]:
        """``sent``, unless no tensor was moved (engines refuse that themselves; this guards
        against one that does not)."""
        if not any(result.get("num_tensors") for result in sent):
            stages.current = "transfer"
            raise SyncStageError(
                f"weight sync ({self.backend}) moved no tensors; a sync that loads nothing is "
                "refused (does the actor's weight iterator yield anything?)", stage="transfer",
            )
        return sent

    @staticmethod
    def _replica_calls(replicas: list[RolloutReplica], method: str):
        return [(f"replica {index}", getattr(r, method)()) for index, r in enumerate(replicas)]

    async def _run_stage(
        self, stage: str, calls: Calls, deadline: float,
        probe: Callable[[], Calls] | None = None,
    ) -> list[Any]:
        loop = asyncio.get_running_loop()
        tasks = [asyncio.ensure_future(call) for _, call in calls]
        if not tasks:
            return []
        names = [name for name, _ in calls]
        done, pending = await asyncio.wait(
            tasks, timeout=max(deadline - loop.time(), 0.0),
            return_when=asyncio.FIRST_EXCEPTION,
        )
        failed = [task for task in done if not task.cancelled() and task.exception()]
        if failed and pending:
            # give the other ranks a moment to report, so the root cause can be named
            await asyncio.wait(pending, timeout=min(_GRACE_SECONDS, max(deadline - loop.time(), 0)))
        failures = [
            (name, task.exception()) for name, task in zip(names, tasks, strict=True)
            if task.done() and not task.cancelled() and task.exception() is not None
        ]
        pending_names = [name for name, task in zip(names, tasks, strict=True)
                         if not task.done()]
        stalled: list[Culprit] = []
        if pending_names and probe is not None:
            stalled = await self._probe(pending_names, probe, failures, names)
        self._cancel([call for (_, call), task in zip(calls, tasks, strict=True)
                      if not task.done()], tasks)
        if failures:
            raise self._failure(stage, names, failures, stalled)
        if pending_names:
            blamed = stalled[0].name if stalled else None
            culprit = f"{blamed} {stalled[0].verdict}; " if stalled else ""
            host = self._addresses.get(blamed) if blamed else None
            raise SyncTimeoutError(
                f"weight sync ({self.backend}) timed out at stage {stage!r} after "
                f"{self.config.sync_timeout_seconds:.0f}s (sync_timeout_seconds): {culprit}"
                f"still waiting on: {', '.join(pending_names)}"
                + (f". {blamed} runs on host {host}" if host else ""),
                stage=stage, pending=pending_names, culprit=blamed, host=host,
            )
        return [task.result() for task in tasks]

    async def _probe(
        self, pending: list[str], probe: Callable[[], Calls],
        failures: list[tuple[str, BaseException]], names: list[str],
    ) -> list[Culprit]:
        """Ask the ``pending`` processes what they are doing; a process that died shows up
        in ``failures``, one that does not answer within a second counts as frozen."""
        asked = [(name, asyncio.ensure_future(call)) for name, call in probe()
                 if name in pending]
        await asyncio.wait([task for _, task in asked], timeout=_PROBE_SECONDS)
        reports: dict[str, dict[str, Any] | None] = {}
        for name, task in asked:
            if not task.done():
                task.cancel()
                reports[name] = None
            elif task.cancelled() or task.exception() is not None:
                exc = task.exception() if not task.cancelled() else None
                if isinstance(exc, ray.exceptions.RayActorError):
                    failures.append((name, exc))
                else:
                    reports[name] = None
            else:
                reports[name] = task.result()
        return stalled_processes(reports, names)

    def _failure(
        self, stage: str, names: list[str], failures: list[tuple[str, BaseException]],
        stalled: list[Culprit],
    ) -> SyncStageError:
        """The error of a failed stage, its root cause in the headline."""
        culprit, reporter, exc = rank_failures(failures, names, stalled)
        host = self._addresses.get(culprit.name)
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

    @staticmethod
    def _cancel(calls: list[Awaitable[Any]], tasks: list[asyncio.Future]) -> None:
        for call in calls:
            if isinstance(call, ray.ObjectRef):
                with contextlib.suppress(Exception):
                    ray.cancel(call)
        for task in tasks:
            task.cancel()

    async def _settle_cleanup(self, budget: float) -> None:
        """Wait (at most ``budget`` seconds, and :data:`_CLEANUP_SECONDS`) for the clean-up
        a failed sync left running, so that no process starts this sync while it still
        aborts the last one."""
        leftovers, self._cleanup = self._cleanup, []
        if not leftovers:
            return
        tasks = [asyncio.ensure_future(ref) for ref in leftovers]
        for task in tasks:
            task.add_done_callback(retrieve_exception)
        limit = min(budget, _CLEANUP_SECONDS)
        _, pending = await asyncio.wait(tasks, timeout=limit)
        if pending:
            logger.warning(
                "%d clean-up call(s) of the last failed sync are still running after %.0fs; "
                "their processes may be frozen (remove_replicas() them)", len(pending), limit,
            )
            for task in pending:
                task.cancel()

    async def _finish_cleanup(self, calls: list[Awaitable[Any]]) -> None:
        """Give ``calls`` a moment; the next sync waits for the Ray calls among them (each
        sync runs on its own event loop when called from synchronous code, so only Ray
        object refs outlive it)."""
        tasks = [asyncio.ensure_future(call) for call in calls]
        for task in tasks:
            task.add_done_callback(retrieve_exception)
        if tasks:
            await asyncio.wait(tasks, timeout=_CLEANUP_GRACE_SECONDS)
        self._cleanup += [call for call in calls if isinstance(call, ray.ObjectRef)]

    async def _recover(self, error: SyncStageError, replicas: list[RolloutReplica]) -> None:
        """After a failed sync: abort the engines everywhere (dropping groups that may be
        half-used), then mark the replicas stale if bytes had started to move, else resume
        those that do not already hold incomplete weights from an earlier failure. Returns
        after :data:`_CLEANUP_GRACE_SECONDS`: what is still running is awaited by the next
        sync."""
        workers = [worker for replica in replicas for worker in replica.workers]
        cleanup = [*self.actor_wg.execute_checkpoint_engine("abort")]
        with contextlib.suppress(Exception):
            cleanup += self.rollout_group(workers).execute_checkpoint_engine("abort")
        await self._finish_cleanup(cleanup)
        if error.stage in _TRANSFER_STAGES:
            self.stale_replicas += [
                r for r in replicas if not any(r is stale for stale in self.stale_replicas)
            ]
            error.args = (
                f"{error.args[0]}. The {len(replicas)} replica(s) in this sync were left paused "
                "with incomplete weights (see manager.stale_replicas); fix the cause and call "
                "update_weights again, or remove_replicas() the broken ones.",
            )
            return
        if self.backend_cls.is_colocated:
            return  # its replicas were never paused
        untouched = [r for r in replicas if not any(r is stale for stale in self.stale_replicas)]
        await self._finish_cleanup([_resume(replica) for replica in untouched])


async def _resume(replica: RolloutReplica) -> None:
    """Restore a replica's KV cache, then let it serve (after a sync that moved no bytes)."""
    await replica.resume_kv_cache()
    await replica.resume_generation()
