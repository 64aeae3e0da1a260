"""The manager that runs one weight sync from ``actor_wg`` to every rollout replica."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

import ray

from weightsync_core.base import CheckpointEngineWithCache
from weightsync_core.config import CheckpointEngineConfig
from weightsync_core.errors import SenderAbortedError, SyncStageError, SyncTimeoutError
from weightsync_core.plugins import load_custom_backend_module
from weightsync_core.protocols import CheckpointEngineWorkerGroup, RolloutReplica
from weightsync_core.ray_group import RayWorkerGroup
from weightsync_core.registry import CheckpointEngineRegistry

__all__ = ["CheckpointEngineManager", "run_sync"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_CLEANUP_SECONDS = 10.0
_GRACE_SECONDS = 2.0
_TRANSFER_STAGES = frozenset({"transfer", "finalize"})


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` from synchronous code (in a helper thread if a loop is running)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _describe(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and cause is not None:
        exc = cause
    if isinstance(exc, ray.exceptions.RayActorError):
        return f"{type(exc).__name__}: the worker process died or is unreachable"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:600]


def _is_collateral(exc: BaseException) -> bool:
    """Errors that only echo another rank's failure (receivers told the sender aborted)."""
    cause = getattr(exc, "cause", exc)
    return isinstance(cause, SenderAbortedError | asyncio.CancelledError)


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
        self.actor_wg = actor_wg
        self.replicas: list[RolloutReplica] = []
        self.stale_replicas: list[RolloutReplica] = []
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

    def remove_replicas(self, replicas: Iterable[RolloutReplica]) -> None:
        """Stop syncing ``replicas`` (e.g. after one failed); the others are untouched."""
        for replica in replicas:
            if not any(replica is known for known in self.replicas):
                raise ValueError(f"replica {replica!r} is not managed by this manager")
            self.replicas = [known for known in self.replicas if known is not replica]
            self.stale_replicas = [known for known in self.stale_replicas if known is not replica]

    def update_weights_sync(self, global_steps: int | None = None) -> dict[str, float]:
        """:meth:`update_weights` for synchronous callers."""
        return run_sync(self.update_weights(global_steps))

    async def update_weights(self, global_steps: int | None = None) -> dict[str, float]:
        """Move the actor's current weights to every replica; return metrics.

        Metrics (``weightsync/`` prefix): ``bytes`` (payload: one copy of the weights),
        ``tensors``, ``buckets``, ``seconds/<stage>``, ``seconds/total``, ``transfer_gbps``
        and ``gbps`` (payload bytes per second).
        """
        return await self._sync(list(self.replicas), global_steps, from_cache=False)

    def update_replicas_from_cache_sync(
        self, replicas: Iterable[RolloutReplica], global_steps: int | None = None
    ) -> dict[str, float]:
        """:meth:`update_replicas_from_cache` for synchronous callers."""
        return run_sync(self.update_replicas_from_cache(replicas, global_steps))

    async def update_replicas_from_cache(
        self, replicas: Iterable[RolloutReplica], global_steps: int | None = None
    ) -> dict[str, float]:
        """Bring managed ``replicas`` (e.g. just added) to the latest update from the actor
        side's cache, without the actor ranks sending again (backends with a cache, such as
        ``kimi``). ``global_steps`` is the version to report (that of the last update).
        Metrics as :meth:`update_weights`; ``bytes`` is what the replicas loaded."""
        if not issubclass(self.backend_cls, CheckpointEngineWithCache):
            raise TypeError(
                f"backend {self.backend!r} keeps no cache of the latest weights on the actor "
                "side; new replicas get the weights from the next update_weights"
            )
        chosen = list(replicas)
        for replica in chosen:
            if not any(replica is known for known in self.replicas):
                raise ValueError(f"replica {replica!r} is not managed; add_replicas() first")
        return await self._sync(chosen, global_steps, from_cache=True)

    async def _sync(
        self, replicas: list[RolloutReplica], global_steps: int | None, from_cache: bool
    ) -> dict[str, float]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.sync_timeout_seconds
        metrics: dict[str, float] = {}
        stage_start = started = loop.time()

        current = "abort_requests"

        async def stage(
            name: str, calls: Callable[[], Sequence[tuple[str, Awaitable[Any]]]],
            own_budget: bool = False,
        ) -> list[Any]:
            """Run one stage; ``own_budget`` stages may outlive the sync deadline a little,
            so that a sync whose transfer finished is not failed by its clean-up."""
            nonlocal stage_start, current
            current = name
            limit = max(deadline, loop.time() + _CLEANUP_SECONDS) if own_budget else deadline
            results = await self._run_stage(name, calls(), limit)
            now = loop.time()
            metrics[f"weightsync/seconds/{name}"] = now - stage_start
            stage_start = now
            return results

        try:
            for name, method in (("abort_requests", "abort_all_requests"),
                                 ("release_kv_cache", "release_kv_cache")):
                await stage(name, lambda method=method: self._replica_calls(replicas, method))
            sent = await self._transfer(stage, replicas, global_steps, from_cache)
        except BaseException as exc:
            error = exc if isinstance(exc, SyncStageError) else SyncStageError(
                f"weight sync ({self.backend}) failed at stage {current!r}: "
                f"{type(exc).__name__}: {exc}", stage=current,
            )
            await asyncio.shield(self._recover(error, replicas))
            if error is exc or isinstance(exc, asyncio.CancelledError):
                raise
            raise error from exc
        self.stale_replicas = [
            stale for stale in self.stale_replicas if not any(stale is r for r in replicas)
        ]
        await stage(
            "resume_generation", lambda: self._replica_calls(replicas, "resume_generation"),
            own_budget=True,
        )

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
        self, stage, replicas: list[RolloutReplica], global_steps: int | None, from_cache: bool
    ):
        actor_wg = self.actor_wg
        actor_names = [f"actor_wg rank {rank}" for rank in range(actor_wg.world_size)]
        if self.backend_cls.is_colocated:
            return await stage("transfer", lambda: list(
                zip(actor_names, actor_wg.update_weights(global_steps), strict=True)
            ))
        workers = [worker for replica in replicas for worker in replica.workers]
        if not workers:
            raise SyncStageError(
                f"backend {self.backend!r} moves weights to rollout workers, but the manager "
                "has no replicas; add_replicas() first", stage="prepare",
            )
        rollout = RayWorkerGroup(workers)
        rollout_names = [
            f"rollout rank {rank} (replica {index}, worker {local})"
            for rank, (index, local) in enumerate(
                (index, local) for index, replica in enumerate(replicas)
                for local in range(len(replica.workers))
            )
        ]
        names = actor_names + rollout_names

        def both(method: str, actor_kwargs=None, rollout_kwargs=None):
            def calls() -> list[tuple[str, Any]]:
                refs = actor_wg.execute_checkpoint_engine(method, **(actor_kwargs or {}))
                refs += rollout.execute_checkpoint_engine(method, **(rollout_kwargs or {}))
                return list(zip(names, refs, strict=True))
            return calls

        metadata = await stage("prepare", both("prepare"))
        try:
            actor_kwargs, rollout_kwargs = self.backend_cls.build_replica_topology(
                actor_wg.world_size, [len(replica.workers) for replica in replicas], metadata
            )
        except Exception as exc:
            raise SyncStageError(
                f"weight sync ({self.backend}) failed at stage 'build_topology': "
                f"{type(exc).__name__}: {exc}", stage="build_topology",
            ) from exc
        await stage("init_process_group", both("init_process_group", actor_kwargs, rollout_kwargs))
        if from_cache:  # the actor ranks send nothing: the rollout workers pull the cache
            results = await stage("transfer", lambda: list(zip(
                rollout_names, rollout.update_weights_from_cache(global_steps), strict=True
            )))
        else:
            results = await stage("transfer", lambda: list(zip(
                names, actor_wg.update_weights(global_steps) + rollout.update_weights(global_steps),
                strict=True,
            )))
        await stage("finalize", both("finalize"))
        # payload per receiver: the senders' counts, or (from the cache) what a worker loaded
        return results[: actor_wg.world_size] if not from_cache else results[:1]

    @staticmethod
    def _replica_calls(replicas: list[RolloutReplica], method: str):
        return [(f"replica {index}", getattr(r, method)()) for index, r in enumerate(replicas)]

    async def _run_stage(
        self, stage: str, calls: Sequence[tuple[str, Awaitable[Any]]], deadline: float
    ) -> list[Any]:
        loop = asyncio.get_running_loop()
        tasks = [asyncio.ensure_future(call) for _, call in calls]
        if not tasks:
            return []
        done, pending = await asyncio.wait(
            tasks, timeout=max(deadline - loop.time(), 0.0),
            return_when=asyncio.FIRST_EXCEPTION,
        )
        failed = [task for task in done if not task.cancelled() and task.exception()]
        if failed and pending:
            # give the other ranks a moment to report, so the root cause can be named
            await asyncio.wait(pending, timeout=min(_GRACE_SECONDS, max(deadline - loop.time(), 0)))
        outcomes = list(zip([name for name, _ in calls], [call for _, call in calls], tasks,
                            strict=True))
        failures = [
            (name, task.exception()) for name, _, task in outcomes
            if task.done() and not task.cancelled() and task.exception() is not None
        ]
        pending_names = [name for name, _, task in outcomes if not task.done()]
        self._cancel([call for _, call, task in outcomes if not task.done()], tasks)
        if failures:
            failures.sort(key=lambda failure: _is_collateral(failure[1]))
            name, exc = failures[0]
            others = "; ".join(f"{other}: {_describe(e)}" for other, e in failures[1:4])
            raise SyncStageError(
                f"weight sync ({self.backend}) failed at stage {stage!r} on {name}: "
                f"{_describe(exc)}" + (f". Also failed: {others}" if others else ""),
                stage=stage, worker=name,
            ) from exc
        if pending_names:
            raise SyncTimeoutError(
                f"weight sync ({self.backend}) timed out at stage {stage!r} after "
                f"{self.config.sync_timeout_seconds:.0f}s (sync_timeout_seconds); still waiting "
                f"on: {', '.join(pending_names)}",
                stage=stage, pending=pending_names,
            )
        return [task.result() for task in tasks]

    @staticmethod
    def _cancel(calls: list[Awaitable[Any]], tasks: list[asyncio.Future]) -> None:
        for call in calls:
            if isinstance(call, ray.ObjectRef):
                with contextlib.suppress(Exception):
                    ray.cancel(call)
        for task in tasks:
            task.cancel()

    async def _recover(self, error: SyncStageError, replicas: list[RolloutReplica]) -> None:
        """After a failed sync: abort the engines everywhere (dropping groups that may be
        half-used), then mark the replicas stale if bytes had started to move, else resume
        those that do not already hold incomplete weights from an earlier failure."""
        workers = [worker for replica in replicas for worker in replica.workers]
        cleanup = [*self.actor_wg.execute_checkpoint_engine("abort")]
        with contextlib.suppress(Exception):
            cleanup += RayWorkerGroup(workers).execute_checkpoint_engine("abort")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*cleanup, return_exceptions=True), timeout=_CLEANUP_SECONDS
            )
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
        untouched = [r for r in replicas if not any(r is stale for stale in self.stale_replicas)]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.gather(*(replica.resume_generation() for replica in untouched)),
                timeout=_CLEANUP_SECONDS,
            )
