"""The manager that runs one weight sync from ``actor_wg`` to every rollout replica."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import sys
import time
import types
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, cast

import ray

from weightsync_core.api.config import (
    ADAPTER_CHECK,
    ADAPTER_KEEP,
    ADAPTER_SPEC,
    BEGIN_SYNC,
    BUILT_SETTINGS,
    DELTA_HELD,
    CheckpointEngineConfig,
)
from weightsync_core.api.engine import CheckpointEngineWithCache
from weightsync_core.api.errors import (
    AdapterMismatchError,
    MetadataError,
    SyncStageError,
    WeightSyncError,
)
from weightsync_core.api.passes import pass_metrics
from weightsync_core.api.plugins import load_custom_backend_module
from weightsync_core.api.protocols import CheckpointEngineWorkerGroup, RolloutReplica
from weightsync_core.api.registry import CheckpointEngineRegistry
from weightsync_core.api.session_key import new_session_key
from weightsync_core.data.adapters import AdapterSpec
from weightsync_core.data.delta import DeltaPlan
from weightsync_core.data.sync_layout import SyncLayout
from weightsync_core.net.blocking import retrieve_exception
from weightsync_core.orchestration.adapter_ledger import AdapterLedger
from weightsync_core.orchestration.blame import (
    describe_exception,
    metadata_culprit,
    settings_mismatch,
)
from weightsync_core.orchestration.commit import ReplicaCommit, commit_replica, switches_whole
from weightsync_core.orchestration.commit_as_staged import CommitsAsStaged
from weightsync_core.orchestration.delta_ledger import DeltaLedger
from weightsync_core.orchestration.ray_group import RayWorkerGroup
from weightsync_core.orchestration.replica_status import replica_status, worker_status
from weightsync_core.orchestration.stages import Calls, SyncStages

__all__ = ["CheckpointEngineManager", "awaitable_or_blocking", "run_sync"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_CLEANUP_SECONDS = 10.0
"""How long the next sync waits for the clean-up calls a failed sync left running, and how
long a sync's closing stages may run past its deadline."""
_CLEANUP_GRACE_SECONDS = 0.2
"""How long a failing sync waits for its clean-up calls before it raises."""
_TRANSFER_STAGES = frozenset({"transfer", "finalize"})
_STAGING_CALLS = ("stage_weights", "commit_staged", "roll_back_commit", "discard_staged",
                  "weights_status")
"""What a rollout worker must take for a sync to be staged (:meth:`stages_syncs`)."""


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` from synchronous code (in a helper thread if a loop is running).
    What it raises is raised as it is, chained to nothing of this function's."""
    if not _loop_running():
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _loop_running() -> bool:
    """Whether this thread runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


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


@dataclass(frozen=True)
class _SyncProcesses:
    """The engine processes of one sync (or one round of it): the actor ranks, then the
    replicas' rollout workers, laid out by ``layout`` (as the engines number them) and named
    as the manager numbers them (``rollout_names``: a round to some of the managed replicas
    numbers its ranks within the round, a failure names them as a sync to all would)."""

    actor: CheckpointEngineWorkerGroup
    rollout: CheckpointEngineWorkerGroup
    layout: SyncLayout
    rollout_names: tuple[str, ...]
    """Each rollout worker's name in the manager's numbering, in ``layout``'s rank order."""

    @property
    def names(self) -> list[str]:
        """Every process's name: actor ranks, then rollout ranks (the manager's numbering)."""
        return [*self.layout.actor_names, *self.rollout_names]

    @property
    def peers(self) -> dict[str, str]:
        """How the engines name each process to their peers (``"rollout rank 0"``, within
        this round) -> its name in :attr:`names`."""
        return {
            **{SyncLayout.actor_peer_name(rank): name
               for rank, name in enumerate(self.layout.actor_names)},
            **{SyncLayout.rollout_peer_name(rank): name
               for rank, name in enumerate(self.rollout_names)},
        }

    def engine_calls(
        self, method: str, actor_kwargs: dict[str, list[Any]] | None = None,
        rollout_kwargs: dict[str, list[Any]] | None = None,
    ) -> Callable[[], Calls]:
        """Calls of ``engine.<method>`` on every process, with per-rank keyword arguments
        for each side."""
        def calls() -> Calls:
            refs = [*self.actor.execute_checkpoint_engine(method, **(actor_kwargs or {})),
                    *self.rollout.execute_checkpoint_engine(method, **(rollout_kwargs or {}))]
            return list(zip(self.names, refs, strict=True))
        return calls

    def per_rank(self, kwargs: dict[str, Any]) -> tuple[dict[str, list[Any]],
                                                        dict[str, list[Any]]]:
        """``kwargs`` as the same per-rank keyword arguments for every actor rank and every
        rollout worker (:meth:`engine_calls`' two sides)."""
        return ({key: [value] * self.layout.actor_ranks for key, value in kwargs.items()},
                {key: [value] * self.layout.rollout_world_size for key, value in kwargs.items()})

    def send_calls(self, global_steps: int | None, options: dict[str, Any],
                   staged: bool = False) -> Callable[[], Calls]:
        """Each process's side of the transfer: the actor ranks send, the rollout workers
        receive (the groups' ``update_weights``; ``staged``: ``stage_weights``)."""
        receive = self.rollout.update_weights
        if staged:
            receive = getattr(self.rollout, "stage_weights", None)
            if receive is None:
                raise TypeError(f"{type(self.rollout).__qualname__} has no stage_weights: its "
                                "workers cannot stage an update; use update_weights")
        return lambda: list(zip(self.names, [
            *self.actor.update_weights(global_steps, **options),
            *receive(global_steps, **options),
        ], strict=True))

    def cache_calls(self, global_steps: int | None) -> Callable[[], Calls]:
        """The rollout workers' loads from the actor side's cache (the actor ranks send
        nothing)."""
        load = getattr(self.rollout, "update_weights_from_cache", None)
        if load is None:
            raise TypeError(f"{type(self.rollout).__qualname__} has no "
                            "update_weights_from_cache: its workers cannot load from a cache")
        return lambda: list(zip(self.rollout_names, load(global_steps), strict=True))


@dataclass
class _Round:
    """One transfer of a sync: to ``replicas``, under delta ``plan`` (None: not
    delta-enabled), of the weights or of an ``adapter``; ``sent`` and ``loaded`` are what
    the senders and the rollout workers reported once it ran."""

    replicas: list[RolloutReplica]
    plan: DeltaPlan | None
    adapter: AdapterSpec | None = None
    """The LoRA adapter it moves (None: the weights)."""
    sent: list[dict[str, Any]] = field(default_factory=list)
    loaded: list[dict[str, Any]] = field(default_factory=list)

    @property
    def moves_patches(self) -> bool:
        """Whether the round moves patches (else whole tensors)."""
        return self.plan is not None and self.plan.is_delta


@dataclass
class _CommitTally:
    """How the commits of a staged sync ended: the names of the replicas that took the
    update, of those rolled back (serving the version they served) and of those left paused
    with a mix of versions, and the first failure (worker or replica name, error)."""

    took: list[str]
    rolled_back: list[str]
    stale: list[str]
    first: tuple[str, BaseException] | None


class CheckpointEngineManager:
    """Coordinates weight syncs between ``actor_wg`` and a set of rollout replicas.

    One sync: abort in-flight requests, release KV cache, prepare, build topology, init
    process groups, send and receive, finalize, resume generation. Every stage awaits Ray
    object refs (no blocking ``ray.get``) under one deadline of
    ``config.sync_timeout_seconds``; a failure raises :class:`SyncStageError` (or
    :class:`SyncTimeoutError`) naming the stage and the worker.

    If a sync fails after bytes started moving, its replicas are left paused (not resumed)
    and listed in :attr:`stale_replicas` until a later sync succeeds or they are removed.

    The rollout side of a sync is one worker group made of the replicas' workers (see
    :meth:`rollout_group`): of the class the replicas name in a ``worker_group_class``
    attribute, else of :attr:`default_rollout_group_class`.

    Args:
        config: the checkpoint-engine configuration.
        actor_wg: the training-side worker group (a :class:`CheckpointEngineWorkerGroup`).
        replicas: the rollout replicas (:class:`RolloutReplica`).
    """

    default_rollout_group_class: ClassVar[type[CheckpointEngineWorkerGroup]] = RayWorkerGroup
    """The rollout side's worker group for replicas that name no ``worker_group_class``:
    Ray handles of :class:`~weightsync_core.worker.rollout.CheckpointEngineWorker` actors."""

    def __init__(
        self,
        config: CheckpointEngineConfig,
        actor_wg: CheckpointEngineWorkerGroup,
        replicas: Iterable[RolloutReplica] = (),
    ) -> None:
        self.config = config
        load_custom_backend_module(config.custom_backend_module, config.trusted_modules)
        self.backend_cls = CheckpointEngineRegistry.get(config.backend)
        self.backend_cls.check_options(config.active_engine_kwargs, config.backend)
        if config.delta and not self.backend_cls.supports_delta:
            why = (" (a colocated engine moves no bytes)" if self.backend_cls.is_colocated
                   else "")
            raise ValueError(
                f"delta=True: backend {config.backend!r} does not move delta syncs{why}; its "
                "engine does not set supports_delta. Set delta=False, or use a backend that "
                "does (gloo, nccl, hccl, nixl, mooncake, kimi, gloo_sharded, nixl_sharded, "
                "mooncake_sharded)"
            )
        self.delta_ledger = DeltaLedger(config.full_verify_every) if config.delta else None
        """Where ``config.delta`` is set: when a sync must be whole for everyone (see
        :meth:`DeltaLedger.rounds`; who holds which version, the processes say)."""
        self.adapter_ledger = AdapterLedger(config.adapter_versions, config.delta,
                                            config.full_verify_every)
        """Which versions of each LoRA adapter every replica serves (:meth:`update_adapter`),
        and each adapter's delta ledger."""
        self.travel_settings = config.travel_settings(self.backend_cls)
        """The settings of ``config`` that change what travels
        (:meth:`CheckpointEngineConfig.travel_settings`): before any byte of a sync moves,
        every process must report its engine was built with the same."""
        self.actor_wg = actor_wg
        self.replicas: list[RolloutReplica] = []
        self.stale_replicas: list[RolloutReplica] = []
        self._addresses: dict[str, str] = {}
        """Host address of each process and replica (by name) as of the last sync; cleared
        when replicas are added or removed."""
        self._answering: tuple[CheckpointEngineWorkerGroup | None, set[str]] = (None, set())
        """The actor group and the processes (by name) that answered
        :data:`~weightsync_core.api.config.BUILT_SETTINGS` in an earlier sync (weightsync's
        own workers): a sync of only those begins in one call
        (:data:`~weightsync_core.api.config.BEGIN_SYNC`). Forgotten with :attr:`_addresses`."""
        self._cleanup: list[ray.ObjectRef] = []
        self._staged: list[RolloutReplica] = []
        """The replicas whose workers hold the stage of the last :meth:`stage_weights`, until
        it is committed or discarded."""
        self._cache_holds_adapter = False
        """Whether the last sync was an adapter sync (an engine with a cache then caches
        the adapter, not the weights, until the next :meth:`update_weights`)."""
        self._commits_as_staged: CommitsAsStaged | None = None
        """During an :meth:`update_weights` with ``config.commit="each"``: the commits it
        starts as each replica's stage completes."""
        self.add_replicas(replicas)

    @property
    def backend(self) -> str:
        """The configured backend name."""
        return self.config.backend

    def add_replicas(self, replicas: Iterable[RolloutReplica]) -> None:
        """Include ``replicas`` from the next sync on.

        Raises:
            ValueError: a replica is already managed, or names another
                ``worker_group_class`` than the managed ones (one sync drives one rollout
                group: manage such replicas with separate managers).
        """
        for replica in replicas:
            if any(replica is known for known in self.replicas):
                raise ValueError(f"replica {replica!r} is already managed")
            group_class = self._worker_group_class(replica)
            if self.replicas and group_class is not self._rollout_group_class():
                raise ValueError(
                    f"replica {replica!r} has workers of group class "
                    f"{group_class.__qualname__}, the managed replicas "
                    f"{self._rollout_group_class().__qualname__}; one sync drives one rollout "
                    "group: manage these replicas with separate managers"
                )
            self.replicas.append(replica)
        self._forget_processes()  # rollout ranks are renumbered

    def remove_replicas(self, replicas: Iterable[RolloutReplica]) -> None:
        """Stop syncing ``replicas`` (e.g. after one failed); the others are untouched."""
        for replica in replicas:
            if not any(replica is known for known in self.replicas):
                raise ValueError(f"replica {replica!r} is not managed by this manager")
            self.replicas = [known for known in self.replicas if known is not replica]
            self.stale_replicas = [known for known in self.stale_replicas if known is not replica]
            self.adapter_ledger.forget(replica)
        self._forget_processes()  # rollout ranks are renumbered

    def _forget_processes(self) -> None:
        """Forget where the processes run and which answer every call: after the replicas
        changed, rollout ranks are renumbered."""
        self._addresses.clear()
        self._answering = (None, set())

    def rollout_group(self, workers: list[Any]) -> CheckpointEngineWorkerGroup:
        """The worker group a sync drives on the rollout side, made of the replicas'
        ``workers``: of the class the replicas name in ``worker_group_class``, else of
        :attr:`default_rollout_group_class`. Override for workers with other calling
        conventions, as ``weightsync-verl`` does for verl's."""
        return self._rollout_group_class()(workers)

    def _rollout_group_class(self) -> type[CheckpointEngineWorkerGroup]:
        """The worker group class of the managed replicas (they all have the same)."""
        if not self.replicas:
            return self.default_rollout_group_class
        return self._worker_group_class(self.replicas[0])

    def _worker_group_class(
        self, replica: RolloutReplica
    ) -> type[CheckpointEngineWorkerGroup]:
        return getattr(replica, "worker_group_class", None) or self.default_rollout_group_class

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
        await self._stages().run(stage, lambda: [
            (SyncLayout.replica_name(index), getattr(replica, method)(**options))
            for index, replica in enumerate(self.replicas)
        ], members=self._replica_workers)

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

        Where :meth:`stages_syncs` (``config.staging="auto"`` and weightsync's own workers),
        in two phases: :meth:`stage_weights` (every replica serving throughout; a failure
        leaves every replica serving its version, not paused, not stale), then
        :meth:`commit_weights` (each replica paused for its switch only; rolled back where
        it fails). Else stop-the-world: every replica paused (requests aborted, KV cache
        released) until the update is loaded; a failure after bytes moved leaves the
        replicas it reached paused and listed in :attr:`stale_replicas`.

        A sync that delivers no tensors fails, and so does one whose tensor names, shapes or
        dtypes differ from what a replica loaded in its previous sync (it is refused before
        the changed tensor is loaded), unless ``allow_manifest_change`` says the model's
        layout changed on purpose.

        Metrics (``weightsync/`` prefix): ``bytes`` (payload: one copy of what the sender
        sent; with a backend that delivers layouts, the most any worker received, and
        ``bytes_sent`` what all actor ranks sent), ``tensors``, ``buckets``,
        ``seconds/<stage>``, ``seconds/total``,
        ``transfer_gbps`` and ``gbps`` (payload bytes per second). With ``config.delta``
        also ``delta`` (1 for a sync of patches, 0 for a full one), ``model_bytes`` (the
        weights' size in the rollout dtype), ``changed_fraction`` (of the elements) and
        ``seconds/diff`` (the sender's diffing) and ``seconds/apply`` (the slowest
        worker's patching and checking), and ``actor_kept_bytes`` (the largest copy an
        actor rank keeps for the next sync). ``staged`` is 1 for a sync in two phases, which
        adds :meth:`commit_weights`' metrics (``seconds/total`` is both phases'), else 0.
        """
        return await self._update_weights(global_steps, allow_manifest_change)

    async def _update_weights(
        self, global_steps: int | None, allow_manifest_change: bool
    ) -> dict[str, float]:
        if not self.stages_syncs():
            self._staged = []  # the workers drop their stages: this sync brings a newer one
            metrics = await self._sync(list(self.replicas), global_steps, False,
                                       allow_manifest_change)
            return {**metrics, "weightsync/staged": 0.0}
        if self.config.commit == "each":
            return await self._stage_and_commit_each(global_steps, allow_manifest_change)
        metrics = await self._stage_weights(global_steps, allow_manifest_change)
        commit = await self._commit_weights()
        metrics.update(commit)
        metrics["weightsync/seconds/total"] += commit["weightsync/seconds/commit"]
        return {**metrics, "weightsync/staged": 1.0}

    async def _stage_and_commit_each(
        self, global_steps: int | None, allow_manifest_change: bool
    ) -> dict[str, float]:
        """A staged sync with ``config.commit="each"``: each replica commits as soon as its
        stage is complete (:class:`CommitsAsStaged`), while the transfer goes on."""
        commits = self._commits_as_staged = CommitsAsStaged(self._commit_replica)
        try:
            metrics = await self._stage_weights(global_steps, allow_manifest_change)
        except SyncStageError as error:
            await commits.close(0.0)  # closed by the stage's recovery; no new commits
            error.args = (f"{error.args[0]}{await self._early_commits(commits)}",)
            raise
        finally:
            self._commits_as_staged = None
        staged_end = time.monotonic()
        await commits.close(self.config.sync_timeout_seconds)
        self._staged, replicas = [], self._staged
        late = [replica for replica in replicas if not commits.committing(replica)]
        outcomes = {id(replica): outcome for replica, outcome in await commits.outcomes()}
        outcomes.update(zip(map(id, late), await asyncio.gather(
            *map(self._commit_replica, late), return_exceptions=True), strict=True))
        commit = self._commit_result(replicas, [outcomes[id(r)] for r in replicas], staged_end)
        metrics.update(commit)
        metrics["weightsync/seconds/total"] += commit["weightsync/seconds/commit"]
        return {**metrics, "weightsync/staged": 1.0}

    async def _early_commits(self, commits: CommitsAsStaged) -> str:
        """After a failed phase 1 with ``commit="each"``: what the replicas committed before
        the failure did, for the sync's error (empty where none was)."""
        started = await commits.outcomes()
        if not started:
            return ""
        replicas = [replica for replica, _ in started]
        tally = self._record_commits(replicas, [outcome for _, outcome in started])
        return (" Committed as their stages completed (commit='each'), before the failure: "
                f"took the update: {tally.took or 'none'}; rolled back and serving: "
                f"{tally.rolled_back or 'none'}; stale: {tally.stale or 'none'}.")

    def stages_syncs(self) -> bool:
        """Whether :meth:`update_weights` runs in two phases (:meth:`stage_weights`, then
        :meth:`commit_weights`): ``config.staging`` is ``"auto"``, the backend moves bytes
        (not colocated), and the rollout group and every worker of every replica take the
        staging calls (weightsync's own workers do; verl's do not), or the replica switches
        as a whole (:class:`~weightsync_core.api.protocols.RolloutReplica`)."""
        if self.config.staging == "never" or self.backend_cls.is_colocated or not self.replicas:
            return False
        if not hasattr(self._rollout_group_class(), "stage_weights"):
            return False
        return all(replica.workers and _stages(replica) for replica in self.replicas)

    def stage_weights_sync(
        self, global_steps: int | None = None, *, allow_manifest_change: bool = False
    ) -> dict[str, float]:
        """:meth:`stage_weights` for synchronous callers."""
        return run_sync(self._stage_weights(global_steps, allow_manifest_change))

    @awaitable_or_blocking
    async def stage_weights(
        self, global_steps: int | None = None, *, allow_manifest_change: bool = False
    ) -> dict[str, float]:
        """Phase 1 of a staged sync: move the actor's current weights into a stage on every
        replica's workers (:meth:`CheckpointEngineWorker.stage_weights`), checked whole,
        while every replica keeps serving its version (none is paused); :meth:`commit_weights`
        then switches them. The stages' of :meth:`update_weights` as they are, the transfer
        into the stages. A failure raises as :meth:`update_weights` does, and leaves every
        replica serving its version, not paused, not stale: every stage is discarded, and
        the next sync proceeds normally. Metrics as :meth:`update_weights`.

        Raises:
            TypeError: the backend hands weights over inside the actor's process (``naive``):
                it has nothing to stage; or the replicas' workers cannot stage (verl's own),
                or ``config.staging`` is ``"never"`` (:meth:`stages_syncs`), saying which.
        """
        return await self._stage_weights(global_steps, allow_manifest_change)

    async def _stage_weights(
        self, global_steps: int | None, allow_manifest_change: bool
    ) -> dict[str, float]:
        if self.backend_cls.is_colocated:
            raise TypeError(f"backend {self.backend!r} hands the weights over inside the "
                            "actor's process: there is no stage; use update_weights")
        if self.replicas and not self.stages_syncs():
            raise TypeError(self._why_no_stage())
        self._staged = []
        return await self._sync(list(self.replicas), global_steps, False,
                                allow_manifest_change, staged=True)

    def commit_weights_sync(self) -> dict[str, float]:
        """:meth:`commit_weights` for synchronous callers."""
        return run_sync(self._commit_weights())

    @awaitable_or_blocking
    async def commit_weights(self) -> dict[str, float]:
        """Phase 2 of a staged sync: on every replica of the last :meth:`stage_weights` at
        once, pause it (``pause_generation(config.pause_mode)``, or ``abort_all_requests``
        where it has none), hand each worker's stage to its server
        (:meth:`CheckpointEngineWorker.commit_staged`), resume it (``resume_generation``):
        a replica is paused for its own switch only. Where a server fails to take its stage,
        its worker rolls it back to the version it served and the replica is resumed on that
        version; a replica with a worker that could not roll back (no copy yet, or it died)
        stays paused and is listed in :attr:`stale_replicas`.

        Returns metrics (``weightsync/`` prefix): ``seconds/commit``, ``pause_seconds`` (the
        longest any replica was paused) and ``replicas_committed``.

        Raises:
            WeightSyncError: nothing is staged (stage first; a failed or discarded stage
                leaves nothing).
            SyncStageError: (stage ``commit``) a replica's server failed to take its stage,
                naming the first worker that failed, which replicas took the update, which
                were rolled back and which are stale; each timeout is
                ``sync_timeout_seconds``.
        """
        return await self._commit_weights()

    async def _commit_weights(self) -> dict[str, float]:
        replicas, self._staged = self._staged, []
        if not replicas:
            raise WeightSyncError("nothing is staged to commit: call stage_weights first (a "
                                  "failed or discarded stage leaves nothing staged)")
        start = time.monotonic()
        outcomes = await asyncio.gather(*map(self._commit_replica, replicas),
                                        return_exceptions=True)
        return self._commit_result(replicas, outcomes, start)

    async def _commit_replica(self, replica: RolloutReplica) -> ReplicaCommit:
        """Phase 2 on one replica (:func:`commit_replica`), paused as ``config.pause_mode``
        says."""
        index = self._replica_index(replica)
        return await commit_replica(replica, self._worker_names(replica),
                                    self.config.sync_timeout_seconds, self._pause_for_switch,
                                    lambda r: r.resume_generation(), self.config.pause_mode,
                                    self._replica_name(replica, index or 0))

    def _commit_result(self, replicas: list[RolloutReplica],
                       outcomes: list[ReplicaCommit | BaseException], start: float
                       ) -> dict[str, float]:
        """The metrics of the commits of ``replicas`` (their ``outcomes``), which ended now
        and started at ``start``; raises the commit's error where one failed."""
        tally = self._record_commits(replicas, outcomes)
        if len(tally.took) < len(replicas):
            raise self._commit_error(tally)
        return {"weightsync/seconds/commit": time.monotonic() - start,
                "weightsync/pause_seconds": max(outcome.paused_seconds for outcome in outcomes
                                                if isinstance(outcome, ReplicaCommit)),
                "weightsync/replicas_committed": float(len(replicas))}

    def weights_status_sync(self) -> dict[str, dict[str, Any]]:
        """:meth:`weights_status` for synchronous callers."""
        return run_sync(self._weights_status())

    @awaitable_or_blocking
    async def weights_status(self) -> dict[str, dict[str, Any]]:
        """What each managed replica (by name) serves, has staged and could roll back to:
        ``{"state", "version", "staged_version", "rollback_version", "workers"}``.
        ``state`` is ``"stale"`` (listed in :attr:`stale_replicas`: paused with a mix of
        versions), ``"mixed"`` (its workers report different versions, or one an incomplete
        update, or one did not answer), ``"staged"`` (serving ``version``, with
        ``staged_version`` staged on every worker) or ``"serving"``; the versions are its
        workers' where they agree, else None; ``workers`` is each worker's own
        :meth:`CheckpointEngineWorker.weights_status` (None where it did not answer within
        ``sync_timeout_seconds``, or has no such call, as verl's workers)."""
        return await self._weights_status()

    async def _weights_status(self) -> dict[str, dict[str, Any]]:
        timeout = self.config.sync_timeout_seconds
        status: dict[str, dict[str, Any]] = {}
        for index, replica in enumerate(self.replicas):
            workers = await asyncio.gather(*(worker_status(worker, timeout)
                                             for worker in replica.workers))
            status[self._replica_name(replica, index)] = replica_status(
                workers, stale=any(replica is known for known in self.stale_replicas))
        return status

    def _why_no_stage(self) -> str:
        """Why :meth:`stages_syncs` is false for these replicas (not colocated)."""
        if self.config.staging == "never":
            return ("config.staging is 'never': syncs are stop-the-world; set staging='auto' "
                    "to stage, or use update_weights")
        group = self._rollout_group_class()
        if not hasattr(group, "stage_weights"):
            return (f"the replicas' worker group {group.__qualname__} has no stage_weights: "
                    "its workers load as they receive (stop-the-world); use update_weights")
        lacking = sorted({type(worker).__name__ for replica in self.replicas
                          if not _stages(replica) for worker in replica.workers
                          if not all(hasattr(worker, m) for m in _STAGING_CALLS)})
        return (f"rollout workers of class(es) {', '.join(lacking)} cannot stage (they lack "
                f"{', '.join(_STAGING_CALLS)}); use update_weights, which is stop-the-world "
                "for them")

    async def _pause_for_switch(self, replica: RolloutReplica) -> None:
        """Pause ``replica`` for a commit: its ``pause_generation(config.pause_mode)``, or,
        for a replica without one, ``abort_all_requests()``."""
        pause = getattr(replica, "pause_generation", None)
        if pause is None:
            await replica.abort_all_requests()
        else:
            await pause(mode=self.config.pause_mode)

    def _record_commits(
        self, replicas: list[RolloutReplica], outcomes: list[ReplicaCommit | BaseException]
    ) -> _CommitTally:
        """Sort the commits of ``replicas`` by their ``outcomes`` (:class:`_CommitTally`);
        the replicas left paused with a mix of versions are marked stale, and those that
        took the update are no longer."""
        took, rolled_back, stale = [], [], []
        first: tuple[str, BaseException] | None = None
        for index, (replica, outcome) in enumerate(zip(replicas, outcomes, strict=True)):
            name = self._replica_name(replica, index)
            if isinstance(outcome, BaseException):  # its pause or resume failed
                first = first or (name, outcome)
                stale.append(replica)
            elif not outcome.failures:
                took.append(replica)
            else:
                first = first or outcome.failures[0]
                (rolled_back if outcome.serving else stale).append(replica)
        self.stale_replicas = [known for known in self.stale_replicas
                               if not any(known is replica for replica in took)]
        self.stale_replicas += [r for r in stale
                                if not any(r is known for known in self.stale_replicas)]
        def names(group: list[RolloutReplica]) -> list[str]:
            return [self._replica_name(r, replicas.index(r)) for r in group]
        return _CommitTally(names(took), names(rolled_back), names(stale), first)

    def _commit_error(self, tally: _CommitTally) -> SyncStageError:
        """The error of a commit where some replica failed."""
        culprit, cause = tally.first or ("", RuntimeError("unknown"))
        return SyncStageError(
            f"weight sync ({self.backend}) failed at stage 'commit': {culprit}: "
            f"{describe_exception(cause)}. Took the update: {tally.took or 'none'}; rolled "
            f"back to the version they served, and serving: {tally.rolled_back or 'none'}; "
            "left paused with a mix of versions (see manager.stale_replicas): "
            f"{tally.stale or 'none'}.", stage="commit", worker=culprit or None)

    def discard_staged_weights_sync(self) -> None:
        """:meth:`discard_staged_weights` for synchronous callers."""
        run_sync(self._discard_staged_weights())

    @awaitable_or_blocking
    async def discard_staged_weights(self) -> None:
        """Drop the stages of the last :meth:`stage_weights` (no replica ever saw them)."""
        await self._discard_staged_weights()

    async def _discard_staged_weights(self) -> None:
        replicas, self._staged = self._staged, []
        await self._finish_cleanup([call for replica in replicas
                                    for call in _discard_calls(replica)])

    async def _recover_stage(self, error: SyncStageError, replicas: list[RolloutReplica]
                             ) -> None:
        """After a failed :meth:`stage_weights`: abort every engine of the sync, and have
        every worker drop what it staged; no replica was paused or changed (but those that
        ``commit="each"`` committed as their stages completed: they keep theirs)."""
        every = [worker for replica in replicas for worker in replica.workers]
        commits = self._commits_as_staged
        if commits is not None:
            await commits.close(_CLEANUP_GRACE_SECONDS)
        discarding = [replica for replica in replicas
                if commits is None or not commits.committing(replica)]
        cleanup = [*_abort_calls(lambda: self.actor_wg, "actor_wg"),
                   *_abort_calls(lambda: self.rollout_group(every), "the rollout workers"),
                   *(call for replica in discarding for call in _discard_calls(replica))]
        await self._finish_cleanup(cleanup)
        if len(discarding) == len(replicas):
            error.args = (f"{error.args[0]}. Nothing was committed: every replica serves the "
                          "version it served, not paused; the stages were discarded.",)
        else:
            error.args = (f"{error.args[0]}. Every replica not committed below serves the "
                          "version it served, not paused; their stages were discarded.",)

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
        if self._cache_holds_adapter:
            raise TypeError(
                f"backend {self.backend!r}'s cache holds the adapter of the last "
                "update_adapter, not the weights: load new replicas from the next "
                "update_weights")
        chosen = list(replicas)
        for replica in chosen:
            if not any(replica is known for known in self.replicas):
                raise ValueError(f"replica {replica!r} is not managed; add_replicas() first")
        return await self._sync(chosen, global_steps, True, False)

    def update_adapter_sync(self, global_steps: int, name: str = "default", *,
                            allow_change: bool = False) -> dict[str, float]:
        """:meth:`update_adapter` for synchronous callers."""
        return run_sync(self._update_adapter(global_steps, name, allow_change))

    @awaitable_or_blocking
    async def update_adapter(self, global_steps: int, name: str = "default", *,
                             allow_change: bool = False) -> dict[str, float]:
        """Move version ``global_steps`` of the actor's LoRA adapter ``name`` (only its
        ``lora_A``/``lora_B`` tensors: :meth:`ActorCheckpointEngineMixin.iter_adapter_weights
        <weightsync_core.worker.ActorCheckpointEngineMixin.iter_adapter_weights>`) to every
        replica, beside the versions each serves; no replica is paused, and the base weights
        are not touched (:meth:`update_weights` moves them, once or when asked). Awaitable,
        or run to the end from synchronous code, like :meth:`update_weights`.

        Before any byte moves, every actor rank's spec of the adapter (rank, alpha, target
        modules) must agree, and every rollout worker must take it: one that holds versions
        of a differently described adapter refuses it (unless ``allow_change``), as does
        a server that cannot serve it; the refusal names both sides. Each tensor is checked
        against the spec as it arrives; a worker's server adds the version only once it is
        whole (:class:`~weightsync_core.worker.adapters.RolloutAdapters`). After the sync,
        every replica keeps its newest ``config.adapter_versions`` versions
        (:attr:`adapter_ledger`, :meth:`adapter_status`); a failed sync leaves each serving
        the versions it served. With ``config.delta``, an adapter sync sends patches
        against the version every worker holds, as :meth:`update_weights` does. Through a
        backend that delivers layouts (the sharded ones) the adapter goes whole to every
        worker (its server slices it, as vLLM's LoRA manager does), whatever the actor
        ranks and the workers hold of the base weights. Through the colocated ``naive``,
        whose replicas are the actor's workers, each rank's in-process server adds the
        version.

        Metrics as :meth:`update_weights` (``staged`` 0), and ``adapter_versions`` (the
        versions each replica now keeps).

        Raises:
            TypeError: the backend hands weights over inside the actor's process (``naive``)
                and the manager has no replicas (the actor's workers, each rank one).
            ValueError: ``global_steps`` is not an integer (a request names the version).
            SyncStageError: as :meth:`update_weights`; stage ``check_adapter`` for a refused
                spec (:class:`~weightsync_core.api.errors.AdapterMismatchError`'s message).
        """
        return await self._update_adapter(global_steps, name, allow_change)

    async def _update_adapter(self, global_steps: int, name: str, allow_change: bool
                              ) -> dict[str, float]:
        if self.backend_cls.is_colocated and not self.replicas:
            raise TypeError(
                f"backend {self.backend!r} hands the weights over inside the actor's process, "
                "and this manager has no replicas: an adapter sync keeps its versions per "
                "replica; pass the actor's workers as replicas (one per rank, as "
                "weightsync-trainer's colocated mode does)")
        if isinstance(global_steps, bool) or not isinstance(global_steps, int):
            raise ValueError(f"update_adapter: global_steps is the version requests name, an "
                             f"integer; got {global_steps!r}")
        replicas = list(self.replicas)
        self._cache_holds_adapter = True  # from its first byte on, whatever the outcome
        metrics = await self._sync(replicas, global_steps, False, allow_change, adapter=name)
        kept = [self.adapter_ledger.kept_after(replica, name, global_steps)
                for replica in replicas]
        for replica, versions in zip(replicas, kept, strict=True):
            self.adapter_ledger.record(replica, name, versions)
        stages = self._stages()
        processes = self._processes(replicas)
        stages.peers = processes.peers
        per_worker = [versions for replica, versions in zip(replicas, kept, strict=True)
                      for _ in replica.workers]
        await stages.run("keep_adapter", lambda: list(zip(
            processes.rollout_names, processes.rollout.execute_checkpoint_engine(
                ADAPTER_KEEP, name=[name] * len(per_worker), versions=per_worker),
            strict=True)))
        metrics["weightsync/adapter_versions"] = float(min(map(len, kept), default=0))
        metrics["weightsync/seconds/keep_adapter"] = stages.elapsed()
        return {**metrics, "weightsync/staged": 0.0}

    async def _check_adapter(self, stages: SyncStages, replicas: list[RolloutReplica],
                             name: str, allow_change: bool) -> AdapterSpec:
        """Stage ``check_adapter`` of :meth:`update_adapter`: every actor rank's spec of
        adapter ``name`` (which must agree), then every rollout worker's check of it.
        Returns the spec.

        Raises:
            SyncStageError: naming the process that differs or refuses, and why.
        """
        processes = self._processes(replicas)
        stages.peers = processes.peers
        actor_names = processes.layout.actor_names
        answers = await stages.run("check_adapter", lambda: list(zip(
            actor_names, processes.actor.execute_checkpoint_engine(
                ADAPTER_SPEC, name=[name] * len(actor_names)), strict=True)))
        specs: list[AdapterSpec] = []
        for process, answer in zip(actor_names, answers, strict=True):
            try:
                specs.append(AdapterSpec.from_dict(answer))
            except (TypeError, ValueError) as error:
                raise stages.blame("check_adapter", process,
                                   f"answered {ADAPTER_SPEC} with {answer!r}: {error}") from None
        for process, spec in zip(actor_names[1:], specs[1:], strict=True):
            try:
                specs[0].check_same(spec, actor_names[0], process)
            except AdapterMismatchError as error:
                raise stages.blame("check_adapter", process, str(error)) from None
        kwargs = {"adapter": specs[0].as_dict(), "allow_change": allow_change}
        await stages.run("check_adapter", lambda: list(zip(
            processes.rollout_names, processes.rollout.execute_checkpoint_engine(
                ADAPTER_CHECK, **processes.per_rank(kwargs)[1]), strict=True)))
        return specs[0]

    async def _recover_adapter(self, error: SyncStageError, replicas: list[RolloutReplica],
                               name: str) -> None:
        """After a failed :meth:`update_adapter`: abort every engine of the sync, and have
        every worker keep exactly the versions of adapter ``name`` its replica served (a
        worker that took the new version drops it); no replica was paused."""
        every = [worker for replica in replicas for worker in replica.workers]
        per_worker = [self.adapter_ledger.held(replica, name)
                      for replica in replicas for _ in replica.workers]
        cleanup = [*_abort_calls(lambda: self.actor_wg, "actor_wg"),
                   *_abort_calls(lambda: self.rollout_group(every), "the rollout workers")]
        if every:
            cleanup += self.rollout_group(every).execute_checkpoint_engine(
                ADAPTER_KEEP, name=[name] * len(every), versions=per_worker)
        await self._finish_cleanup(cleanup)
        error.args = (f"{error.args[0]}. Every replica serves the versions of adapter "
                      f"{name!r} it served, not paused.",)

    def adapter_status(self) -> dict[str, dict[str, list[int]]]:
        """Per replica (``"replica 0"``, ...): the versions of each LoRA adapter it serves,
        oldest first (:attr:`adapter_ledger`); a request may name any of them."""
        return self.adapter_ledger.status(
            [(self._replica_name(replica, index), replica)
             for index, replica in enumerate(self.replicas)])

    def _stages(self) -> SyncStages:
        """Stages under one deadline of ``sync_timeout_seconds`` from now."""
        return SyncStages(self.backend, self.config.sync_timeout_seconds, self._addresses)

    async def _sync(
        self, replicas: list[RolloutReplica], global_steps: int | None, from_cache: bool,
        allow_manifest_change: bool, staged: bool = False, adapter: str | None = None,
    ) -> dict[str, float]:
        """One sync to ``replicas``: pause them, move the weights (in one round, or, in a
        delta sync where only some replicas hold the actor side's version, a round of
        patches to those and one of whole tensors to the rest), resume them; returns the
        metrics. After a failure, :meth:`_recover` cleans up and the stage's error is raised.
        ``staged``: phase 1 of a staged sync, into the workers' stages, nothing paused (a
        failure discards every stage: :meth:`_recover_stage`). ``adapter``: a sync of that
        LoRA adapter (:meth:`update_adapter`), nothing paused (a failure leaves every
        replica serving the versions it served: :meth:`_recover_adapter`)."""
        stages = self._stages()
        await self._settle_cleanup(self.config.sync_timeout_seconds / 2)
        # a colocated engine (naive) hands the weights over inside each actor process, which
        # also serves generation: as in verl, the replicas are not paused around it
        paused = (replicas if not (self.backend_cls.is_colocated or staged or adapter)
                  else [])
        if not (adapter or from_cache):
            self._cache_holds_adapter = False
        ledger = (self.delta_ledger if adapter is None
                  else self.adapter_ledger.delta_ledger(adapter))
        if from_cache:
            ledger = None  # sends nothing: the actor side's copy is untouched
        rounds: list[_Round] = []
        done: list[_Round] = []
        try:
            await stages.run("abort_requests", self._replica_calls(paused, "abort_all_requests"),
                             members=self._replica_workers)
            await stages.run("release_kv_cache", self._replica_calls(paused, "release_kv_cache"),
                             members=self._replica_workers)
            spec = (None if adapter is None else
                    await self._check_adapter(stages, replicas, adapter, allow_manifest_change))
            rounds = await self._rounds(stages, replicas, ledger, allow_manifest_change, spec)
            for round_ in rounds:
                await self._move(stages, round_, global_steps, from_cache,
                                 allow_manifest_change, mixed=len(rounds) > 1, staged=staged)
                done.append(round_)
        except BaseException as exc:
            if ledger is not None:
                # (a load from the cache sends nothing: the actor side's copy is untouched,
                # and the workers that loaded forget theirs: they report none next sync)
                ledger.failed()
            error = exc if isinstance(exc, SyncStageError) else stages.error(exc)
            in_flight = rounds[len(done)].replicas if len(done) < len(rounds) else replicas
            recovery = (self._recover_stage(error, replicas) if staged else
                        self._recover_adapter(error, replicas, adapter) if adapter else
                        self._recover(error, replicas, in_flight))
            await asyncio.shield(recovery)
            if error is exc or isinstance(exc, asyncio.CancelledError):
                raise
            raise error from exc
        if staged:
            self._staged = list(replicas)
        elif not adapter:
            self.stale_replicas = [
                stale for stale in self.stale_replicas if not any(stale is r for r in replicas)
            ]
        if ledger is not None:
            ledger.succeeded((round_.replicas, round_.plan) for round_ in rounds if round_.plan)
        await stages.run("resume_kv_cache", self._replica_calls(paused, "resume_kv_cache"),
                         min_seconds=_CLEANUP_SECONDS, members=self._replica_workers)
        await stages.run("resume_generation", self._replica_calls(paused, "resume_generation"),
                         min_seconds=_CLEANUP_SECONDS, members=self._replica_workers)
        metrics = self._sync_metrics(stages, rounds, len(replicas),
                                     sharded=self.backend_cls.executes_layouts)
        if ledger is not None:
            metrics.update(_delta_metrics(rounds, self.backend_cls.encodes_own_share))
        return metrics

    async def _rounds(self, stages: SyncStages, replicas: list[RolloutReplica],
                      ledger: DeltaLedger | None, allow_manifest_change: bool,
                      adapter: AdapterSpec | None) -> list[_Round]:
        """How this sync moves the weights (or ``adapter``): one round to every replica, or,
        in a delta sync (``ledger``) where only some hold the actor side's version, patches
        to those first, then whole tensors to the rest (:meth:`DeltaLedger.rounds`, from
        what the processes report holding: :meth:`_held_versions`)."""
        if ledger is None:
            return [_Round(replicas, None, adapter)]
        actor_version, held = await self._held_versions(stages, replicas, adapter)
        return [_Round(group, plan, adapter) for group, plan in ledger.rounds(
            replicas, actor_version, held, force_full=allow_manifest_change)]

    async def _held_versions(self, stages: SyncStages, replicas: list[RolloutReplica],
                             adapter: AdapterSpec | None = None,
                             ) -> tuple[str | None, list[list[str | None]]]:
        """Ask every actor rank and every worker of ``replicas``, in stage ``locate``, which
        delta version it holds (:data:`~weightsync_core.api.config.DELTA_HELD`; of
        ``adapter`` where given); a process that cannot say holds none. Returns actor rank
        0's version (the rank that sends, whatever else does:
        :meth:`_fall_back_where_senders_lack_the_base` checks the others once their roles
        are known) and, per replica, its workers' versions."""
        processes = self._processes(replicas)
        stages.peers = processes.peers
        held = processes.engine_calls(DELTA_HELD, *processes.per_rank(_held_of(adapter)))
        answers = await stages.run("locate", lambda: [
            (name, _answer_or_none(call, DELTA_HELD)) for name, call in held()])
        versions = [_held_version(answer) for answer in answers]
        first = processes.layout.actor_ranks
        per_replica: list[list[str | None]] = []
        for replica in replicas:
            per_replica.append(versions[first:first + len(replica.workers)])
            first += len(replica.workers)
        return versions[0], per_replica

    async def _fall_back_where_senders_lack_the_base(
        self, stages: SyncStages, processes: _SyncProcesses, round_: _Round
    ) -> None:
        """Once the engines know their roles (after ``init_process_group``): make a round of
        patches a round of whole tensors (same version) where an actor rank that sends, or
        keeps a slice of the copy, does not hold its base (a relay of a multi-sender engine
        that had no share of an earlier sync, a rank that restarted, one that cannot say),
        so that it falls back instead of failing."""
        plan = round_.plan
        if plan is None or not plan.is_delta:
            return
        names = processes.layout.actor_names
        kwargs = processes.per_rank(_held_of(round_.adapter))[0]
        answers = await stages.run("init_process_group", lambda: [
            (name, _answer_or_none(ref, DELTA_HELD)) for name, ref in zip(
                names, processes.actor.execute_checkpoint_engine(DELTA_HELD, **kwargs),
                strict=True)])
        lacking = [name for name, answer in zip(names, answers, strict=True)
                   if _needs_base(answer) and _held_version(answer) != plan.base]
        if lacking:
            logger.info("delta sync: %s hold(s) no copy of version %s; whole tensors to "
                        "replica(s) %s instead of patches", ", ".join(lacking), plan.base,
                        self._indices(round_.replicas))
            round_.plan = DeltaPlan(plan.version)

    async def _move(self, stages: SyncStages, round_: _Round, global_steps: int | None,
                    from_cache: bool, allow_manifest_change: bool, mixed: bool,
                    staged: bool = False) -> None:
        """One round's transfer; fills in what ``round_`` sent and loaded. A failure in one
        of the two rounds of a mixed delta sync says which replicas it moved to (its error
        names processes and replicas as the manager numbers them, as every sync's does)."""
        options: dict[str, Any] = {"allow_manifest_change": True} if allow_manifest_change else {}
        if round_.adapter is not None:
            options["adapter"] = round_.adapter.as_dict()
        try:
            if self.backend_cls.is_colocated:
                round_.sent = await self._hand_over_in_process(stages, global_steps, options)
            else:
                round_.sent, round_.loaded = await self._send_to_replicas(
                    stages, round_, global_steps, from_cache, options, staged
                )
            self._check_tensors_moved(round_.sent)
        except SyncStageError as error:
            if mixed:
                error.args = (f"{error.args[0]} [in the round of "
                              f"{'patches' if round_.moves_patches else 'whole tensors'} to "
                              f"replica(s) {self._indices(round_.replicas)} of this manager; "
                              "processes are named as this manager numbers them; rollout "
                              "ranks inside the engines' own messages count within the "
                              "round]",)
            raise

    def _indices(self, replicas: list[RolloutReplica]) -> list[int]:
        """The positions of ``replicas`` among the managed ones."""
        return [index for index, known in enumerate(self.replicas)
                if any(known is replica for replica in replicas)]

    async def _hand_over_in_process(
        self, stages: SyncStages, global_steps: int | None, options: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """A colocated engine's transfer: each actor rank loads its weights into the server
        in its own process. Returns what each rank moved."""
        layout = self._layout([])
        return await stages.run("transfer", lambda: list(zip(
            layout.actor_names, self.actor_wg.update_weights(global_steps, **options),
            strict=True,
        )))

    async def _send_to_replicas(
        self, stages: SyncStages, round_: _Round, global_steps: int | None,
        from_cache: bool, options: dict[str, Any], staged: bool = False,
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The engines' stages of a sync from the actor ranks (or, ``from_cache``, the actor
        side's cache) to the workers of ``round_``'s replicas, under its delta plan (which
        may fall back to whole tensors once the engines know their roles). Returns what was
        moved (the senders' counts, or what one worker loaded from the cache) and what each
        worker loaded."""
        replicas = round_.replicas
        processes = self._processes(replicas)
        layout = processes.layout
        stages.peers = processes.peers
        progress = processes.engine_calls("sync_progress")
        key = new_session_key()  # this sync's secret, handed to every process through Ray
        keys = {"key": [key] * layout.actor_ranks}, {"key": [key] * layout.rollout_world_size}
        # an engine that delivers layouts plans an adapter sync as whole tensors
        adapter = ({"adapter": round_.adapter.name}
                   if round_.adapter is not None and self.backend_cls.executes_layouts else {})
        if self._answer_every_call(processes):
            actor_adapter, rollout_adapter = processes.per_rank(adapter)
            keys = {**keys[0], **actor_adapter}, {**keys[1], **rollout_adapter}
            metadata = await self._begin(stages, processes, replicas, keys, progress)
        else:
            await stages.run("authenticate", processes.engine_calls("set_session_key", *keys),
                             progress)
            await self._locate(stages, processes, replicas)
            metadata = await stages.run("prepare", processes.engine_calls(
                "prepare", *processes.per_rank(adapter)), progress)
        actor_kwargs, rollout_kwargs = self._topology(stages, processes, metadata)
        await stages.run("init_process_group", processes.engine_calls(
            "init_process_group", actor_kwargs, rollout_kwargs,
        ), progress)
        await self._fall_back_where_senders_lack_the_base(stages, processes, round_)
        if round_.plan is not None:
            options = {**options, "delta_base": round_.plan.base,
                       "delta_version": round_.plan.version}
        if from_cache:
            results = await stages.run("transfer", processes.cache_calls(global_steps), progress)
            sent, loaded = results[:1], results
        else:
            calls = processes.send_calls(global_steps, options, staged)
            if self._commits_as_staged is not None:
                calls = self._commits_as_staged.watching(calls, layout.actor_ranks, replicas)
            results = await stages.run("transfer", calls, progress)
            sent, loaded = results[: layout.actor_ranks], results[layout.actor_ranks:]
        await stages.run("finalize", processes.engine_calls("finalize"), progress)
        return sent, loaded

    def _layout(self, replicas: list[RolloutReplica]) -> SyncLayout:
        """This sync's layout: ``actor_wg``'s ranks and the workers of ``replicas``.

        Raises:
            SyncStageError: (stage ``prepare``) a replica has no workers.
        """
        try:
            return SyncLayout(
                self.actor_wg.world_size, tuple(len(replica.workers) for replica in replicas)
            )
        except ValueError as exc:
            raise SyncStageError(
                f"weight sync ({self.backend}) failed at stage 'prepare': {exc}",
                stage="prepare",
            ) from exc

    def _processes(self, replicas: list[RolloutReplica]) -> _SyncProcesses:
        """The actor ranks and the workers of ``replicas`` (at least one), as one sync
        drives them."""
        workers = [worker for replica in replicas for worker in replica.workers]
        if not workers:
            raise SyncStageError(
                f"backend {self.backend!r} moves weights to rollout workers, but the manager "
                "has no replicas; add_replicas() first", stage="prepare",
            )
        layout = self._layout(replicas)
        return _SyncProcesses(
            actor=self.actor_wg, rollout=self.rollout_group(workers), layout=layout,
            rollout_names=tuple(name for replica in replicas
                                for name in self._worker_names(replica)),
        )

    def _replica_index(self, replica: RolloutReplica) -> int | None:
        """``replica``'s position among the managed replicas (None: not managed)."""
        return next((index for index, known in enumerate(self.replicas) if known is replica),
                    None)

    def _replica_name(self, replica: RolloutReplica, fallback: int) -> str:
        """How errors name ``replica``: by its position among the managed replicas (a
        sync's replicas at position ``fallback`` where it is not managed)."""
        index = self._replica_index(replica)
        return SyncLayout.replica_name(fallback if index is None else index)

    def _worker_names(self, replica: RolloutReplica) -> list[str]:
        """How errors name the workers of ``replica``, as :meth:`SyncLayout.rollout_name`
        does in a sync to every managed replica (``"rollout rank 3 (replica 1, worker
        0)"``), whichever replicas the sync or its round moves to."""
        index = self._replica_index(replica)
        if index is None:  # not managed (any longer): numbered after the managed ones
            index, first = len(self.replicas), sum(len(r.workers) for r in self.replicas)
        else:
            first = sum(len(known.workers) for known in self.replicas[:index])
        return [f"{SyncLayout.rollout_peer_name(first + worker)} (replica {index}, "
                f"worker {worker})" for worker in range(len(replica.workers))]

    def _replica_workers(self, name: str) -> Calls:
        """For the managed replica errors call ``name`` (``"replica 1"``), a call to each
        of its workers asking what it is doing (``sync_progress``, through the rollout
        worker group), named as errors name the worker: when a replica's call fails because
        a process died, the stage blames the worker that died (see
        :meth:`SyncStages.run`'s ``members``)."""
        replica = next((known for index, known in enumerate(self.replicas)
                        if SyncLayout.replica_name(index) == name), None)
        if replica is None or not replica.workers:
            return []
        refs = self.rollout_group(list(replica.workers)).execute_checkpoint_engine(
            "sync_progress")
        return list(zip(self._worker_names(replica), refs, strict=True))

    def _answer_every_call(self, processes: _SyncProcesses) -> bool:
        """Whether every process of this sync answered
        :data:`~weightsync_core.api.config.BUILT_SETTINGS` in an earlier sync, so that it
        also answers :data:`~weightsync_core.api.config.BEGIN_SYNC` (weightsync's own workers
        do; verl's hand such calls to their engine, which has no such method)."""
        group, answering = self._answering
        return group is self.actor_wg and answering.issuperset(processes.names)

    async def _begin(
        self, stages: SyncStages, processes: _SyncProcesses, replicas: list[RolloutReplica],
        keys: tuple[dict[str, list[Any]], dict[str, list[Any]]], progress: Callable[[], Calls],
    ) -> list[Any]:
        """Stages ``authenticate``, ``locate`` and ``prepare`` in one call per process
        (:data:`~weightsync_core.api.config.BEGIN_SYNC`, timed as stage ``prepare``; a
        process's failure names the stage it failed in): what :meth:`_locate` learns is
        checked as it checks it. Returns each process's metadata from ``prepare``."""
        answers = await stages.run("prepare", processes.engine_calls(BEGIN_SYNC, *keys),
                                   progress)
        for name, answer in zip(processes.names, answers, strict=True):
            if not isinstance(answer, dict) or not {"address", "settings", "metadata"} <= set(
                    answer):
                raise stages.blame("prepare", name, f"answered {BEGIN_SYNC} with "
                                   f"{type(answer).__name__}, not its address, settings and "
                                   "metadata")
        self._located(stages, processes, replicas, [answer["address"] for answer in answers],
                      [answer["settings"] for answer in answers])
        return [answer["metadata"] for answer in answers]

    async def _locate(self, stages: SyncStages, processes: _SyncProcesses,
                      replicas: list[RolloutReplica]) -> None:
        """Learn where each process runs, so that a failure names the host (a cable, a
        switch); a replica's stages (abort, resume) name the host of its first worker. In
        the same stage, ask every process what its engine was built with
        (:data:`~weightsync_core.api.config.BUILT_SETTINGS`) and refuse the sync, at stage
        ``prepare`` and before any byte moves, where that differs from this manager's
        config (:meth:`_check_settings`)."""
        addresses = processes.engine_calls("address")
        settings = processes.engine_calls(BUILT_SETTINGS)
        world_size = processes.layout.world_size
        results = await stages.run("locate", lambda: [
            *addresses(), *((name, _answer_or_none(call, BUILT_SETTINGS))
                            for name, call in settings()),
        ])
        self._located(stages, processes, replicas, results[:world_size],
                      results[world_size:])
        answering = {name for name, settings in zip(processes.names, results[world_size:],
                                                    strict=True) if settings is not None}
        group, known = self._answering
        self._answering = (self.actor_wg,
                           answering | (known if group is self.actor_wg else set()))

    def _located(self, stages: SyncStages, processes: _SyncProcesses,
                 replicas: list[RolloutReplica], hosts: list[Any], reported: list[Any]) -> None:
        """Take what stage ``locate`` learned: each process's host (``hosts``, in
        :attr:`_SyncProcesses.names` order) and the settings its engine was built with
        (``reported``, None where it could not say), refused where they differ from this
        manager's (:meth:`_check_settings`)."""
        processes.layout.with_hosts(hosts)  # every answer a host name
        self._addresses.update(zip(processes.names, hosts, strict=True))
        first = processes.layout.actor_ranks
        for position, replica in enumerate(replicas):
            self._addresses[self._replica_name(replica, position)] = hosts[first]
            first += len(replica.workers)
        self._check_settings(stages, processes, reported)

    def _check_settings(self, stages: SyncStages, processes: _SyncProcesses,
                        reported: list[Any]) -> None:
        """Refuse a sync where a process's engine was built with settings that change what
        travels other than this manager's config says (:attr:`travel_settings`): a
        process built with ``rollout_dtype='float32'`` under a manager that says
        ``'bfloat16'`` would serve float32 weights. Processes whose worker could not say
        (``reported`` None) are not compared.

        Raises:
            SyncStageError: at stage ``prepare``, naming the process, the setting and both
                values.
        """
        found = settings_mismatch(self.travel_settings, reported, processes.names)
        if found is not None:
            raise stages.blame("prepare", *found)

    def _topology(
        self, stages: SyncStages, processes: _SyncProcesses, metadata: list[Any]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """The backend's per-rank ``init_process_group`` arguments (actor side, rollout
        side) from what ``prepare`` returned; a failure is stage ``build_topology``'s.

        Engines get the sizes (``build_topology(layout.actor_ranks,
        layout.rollout_world_size, metadata)``, verl's signature), or the workers of each
        replica where they ask for them (``build_replica_topology``)."""
        layout = processes.layout
        try:
            actor_kwargs, rollout_kwargs = self.backend_cls.build_replica_topology(
                layout.actor_ranks, list(layout.replica_workers), metadata,
            )
        except Exception as exc:
            raise self._topology_error(stages, processes.names, metadata, exc) from exc
        # engines written for verl may name the method too (verl's manager overwrites it)
        actor_kwargs.pop("method", None)
        rollout_kwargs.pop("method", None)
        return actor_kwargs, rollout_kwargs

    @staticmethod
    def _topology_error(
        stages: SyncStages, names: list[str], metadata: list[Any], exc: Exception
    ) -> SyncStageError:
        """The error of a failed ``build_topology``: where one process's ``prepare()``
        returned metadata the others did not (not a dict, a key missing, a value of the
        wrong kind), that process is blamed at stage ``prepare``, before any byte moved;
        else the builder's own error, at stage ``build_topology``."""
        found = metadata_culprit(exc, metadata)
        if found is None or not 0 <= found[0] < len(names):
            return stages.error(exc, "build_topology")
        index, problem = found
        detail = "" if isinstance(exc, MetadataError) else (
            f" (build_topology failed on it: {describe_exception(exc)})")
        return stages.blame("prepare", names[index],
                            f"returned metadata {problem} from prepare(){detail}")

    def _check_tensors_moved(self, sent: list[dict[str, Any]]) -> None:
        """Refuse a sync that moved no tensor (engines refuse that themselves; this guards
        against one that does not)."""
        if not any(result.get("num_tensors") for result in sent):
            raise SyncStageError(
                f"weight sync ({self.backend}) moved no tensors; a sync that loads nothing is "
                "refused (does the actor's weight iterator yield anything?)", stage="transfer",
            )

    @staticmethod
    def _sync_metrics(
        stages: SyncStages, rounds: list[_Round], replicas: int, sharded: bool = False
    ) -> dict[str, float]:
        """The stages' timings (summed over rounds) and what the sync moved (see
        :meth:`update_weights`). ``sharded`` (every actor rank sent its own pieces, each
        worker received only its boxes): ``bytes`` is the most any rollout worker received,
        and ``bytes_sent`` what all actor ranks sent together."""
        metrics = dict(stages.metrics)
        total = stages.elapsed()
        side = "loaded" if sharded else "sent"
        nbytes = sum(max((r.get("nbytes", 0) for r in getattr(round_, side)), default=0)
                     for round_ in rounds)
        if sharded:
            metrics["weightsync/bytes_sent"] = float(sum(
                r.get("nbytes", 0) for round_ in rounds for r in round_.sent))
        transfer_seconds = metrics.get("weightsync/seconds/transfer", 0.0)
        metrics.update({
            "weightsync/bytes": float(nbytes),
            "weightsync/tensors": float(max(
                (r.get("num_tensors", 0) for round_ in rounds for r in round_.sent), default=0)),
            "weightsync/buckets": float(sum(
                max((r.get("num_buckets", 0) for r in round_.sent), default=0)
                for round_ in rounds)),
            "weightsync/replicas": float(replicas),
            "weightsync/seconds/total": total,
            "weightsync/transfer_gbps": (
                nbytes / transfer_seconds / 1e9 if transfer_seconds else 0.0
            ),
            "weightsync/gbps": nbytes / total / 1e9 if total else 0.0,
        })
        metrics.update(pass_metrics(
            report for round_ in rounds for report in (*round_.sent, *round_.loaded)))
        return metrics

    def _replica_calls(self, replicas: list[RolloutReplica], method: str
                       ) -> Callable[[], Calls]:
        """Calls of ``replica.<method>()`` on each of ``replicas``, named by their
        positions among the managed replicas."""
        return lambda: [(self._replica_name(replica, position), getattr(replica, method)())
                        for position, replica in enumerate(replicas)]

    async def run_stage(
        self, stage: str, calls: Calls, deadline: float,
        probe: Callable[[], Calls] | None = None,
    ) -> list[Any]:
        """Run one stage of an integration's own (``weightsync-verl`` runs verl's naive
        hand-over so) with the manager's deadline and blame: ``calls`` are ``(process name,
        Ray object ref)`` pairs, awaited until ``deadline`` (event-loop time); a call that
        fails or is still running then raises
        :class:`~weightsync_core.api.errors.SyncStageError` naming the stage and the processes
        (``probe``, if given, returns calls that report what the stalled ones are doing)."""
        stages = self._stages()
        stages.deadline = deadline
        return await stages.run(stage, lambda: calls, probe)

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

    async def _recover(self, error: SyncStageError, replicas: list[RolloutReplica],
                       in_flight: list[RolloutReplica]) -> None:
        """After a failed sync to ``replicas``: abort the engines of the round that failed
        (``in_flight``'s workers and the actor ranks; dropping groups that may be
        half-used), mark ``in_flight`` stale if bytes had started to move, and resume the
        replicas that do not hold incomplete weights (those of a round that ended, and those
        of none yet). Returns after :data:`_CLEANUP_GRACE_SECONDS`: what is still running is
        awaited by the next sync."""
        workers = [worker for replica in in_flight for worker in replica.workers]
        cleanup = [*_abort_calls(lambda: self.actor_wg, "actor_wg"),
                   *_abort_calls(lambda: self.rollout_group(workers), "the rollout workers")]
        await self._finish_cleanup(cleanup)
        if error.stage in _TRANSFER_STAGES:
            self.stale_replicas += [
                r for r in in_flight if not any(r is stale for stale in self.stale_replicas)
            ]
            others = len(replicas) - len(in_flight)
            resumed = f"; the {others} other replica(s) were resumed" if others else ""
            error.args = (
                f"{error.args[0]}. The {len(in_flight)} replica(s) it moved to were left "
                "paused with incomplete weights (see manager.stale_replicas); fix the cause and "
                f"call update_weights again, or remove_replicas() the broken ones{resumed}.",
            )
        if self.backend_cls.is_colocated:
            return  # its replicas were never paused
        untouched = [r for r in replicas if not any(r is stale for stale in self.stale_replicas)]
        await self._finish_cleanup([_resume(replica) for replica in untouched])


def _stages(replica: RolloutReplica) -> bool:
    """Whether ``replica`` takes staged syncs: it switches as a whole, or every worker of it
    takes the staging calls."""
    return switches_whole(replica) or all(
        hasattr(worker, method) for worker in replica.workers for method in _STAGING_CALLS)


def _discard_calls(replica: RolloutReplica) -> list[Awaitable[Any]]:
    """The calls that drop ``replica``'s stage: its own where it switches as a whole, else
    each worker's."""
    if switches_whole(replica):
        return [cast(Any, replica).discard_staged()]
    return [worker.discard_staged.remote() for worker in replica.workers]


def _delta_metrics(rounds: list[_Round], shares: bool) -> dict[str, float]:
    """What the sending rank of a delta-enabled sync reported (the weights' size, the
    fraction of elements that changed, the seconds spent diffing), summed over the actor
    ranks where each sends its own share (``shares``), the fraction of its replicas that got
    patches (``delta``: 1 or 0 where it was one round) and the longest any rollout worker
    spent applying them. With ``shares``, ``bytes`` is what the ranks' shares sent.
    ``actor_kept_bytes``: the largest copy any actor rank keeps for the next sync."""
    def reported(round_: _Round) -> dict[str, float]:
        senders = [result for result in round_.sent if "delta_elements" in result]
        if not shares:
            senders = senders[:1]
        keys = ("delta_elements", "delta_changed", "delta_model_bytes", "delta_wire_bytes",
                "delta_seconds")
        return {key: sum(float(result.get(key, 0.0)) for result in senders) for key in keys}

    reports = [reported(round_) for round_ in rounds]
    patched = [round_ for round_ in rounds if round_.moves_patches]
    first = reports[rounds.index((patched or rounds)[0])]
    elements = first["delta_elements"]
    replicas = sum(len(round_.replicas) for round_ in rounds)
    metrics = {
        "weightsync/seconds/apply": max((result.get("delta_seconds", 0.0)
                                         for round_ in rounds for result in round_.loaded),
                                        default=0.0),
        "weightsync/delta": (sum(len(round_.replicas) for round_ in patched) / replicas
                             if replicas else 0.0),
        "weightsync/model_bytes": first["delta_model_bytes"],
        "weightsync/changed_fraction": first["delta_changed"] / elements if elements else 0.0,
        "weightsync/seconds/diff": sum(report["delta_seconds"] for report in reports),
    }
    if shares:
        metrics["weightsync/bytes"] = sum(report["delta_wire_bytes"] for report in reports)
    kept = [result["delta_kept_bytes"] for result in rounds[-1].sent
            if "delta_kept_bytes" in result]
    if kept:
        metrics["weightsync/actor_kept_bytes"] = max(kept)
    return metrics


def _abort_calls(
    group: Callable[[], CheckpointEngineWorkerGroup], side: str
) -> list[Awaitable[Any]]:
    """``engine.abort()`` on every process of ``group()``; a group that cannot even start
    the calls is logged and skipped, so that the sync's own error is what the caller sees
    and the replicas are still resumed or listed stale."""
    try:
        return list(group().execute_checkpoint_engine("abort"))
    except Exception as exc:
        logger.warning("could not abort the engines of %s after the failed sync: %r", side, exc)
        return []


async def _answer_or_none(call: Awaitable[Any], method: str) -> Any:
    """What a process answers ``method`` (:data:`~weightsync_core.api.config.BUILT_SETTINGS`,
    :data:`~weightsync_core.api.config.DELTA_HELD`) with, or None where its worker does not know
    the call (verl's own workers hand it to their engine, which has no such method): such a
    process is not compared, and holds no known delta version. Any other failure (a process
    that died) is the stage's."""
    try:
        return await call
    except AttributeError as exc:  # a Ray task error is an instance of its cause's class
        if method in str(exc):
            return None
        raise


def _held_of(adapter: AdapterSpec | None) -> dict[str, Any]:
    """The keyword arguments of a :data:`~weightsync_core.api.config.DELTA_HELD` call: of
    ``adapter``'s copy, or (none) of the weights'."""
    return {} if adapter is None else {"adapter": adapter.name}


def _held_version(answer: Any) -> str | None:
    """The delta version in a process's :data:`~weightsync_core.api.config.DELTA_HELD` answer
    (None: it holds none, or said nothing usable)."""
    version = answer.get("version") if isinstance(answer, dict) else None
    return version if isinstance(version, str) else None


def _needs_base(answer: Any) -> bool:
    """Whether an actor rank's :data:`~weightsync_core.api.config.DELTA_HELD` answer says a
    round of patches needs it to hold their base; a rank that could not say is taken to."""
    return not isinstance(answer, dict) or answer.get("needs_base") is not False


async def _resume(replica: RolloutReplica) -> None:
    """Restore a replica's KV cache, then let it serve (after a sync that moved no bytes)."""
    await replica.resume_kv_cache()
    await replica.resume_generation()
