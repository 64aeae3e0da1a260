"""Worker-side owners of a checkpoint engine: the rollout worker and the actor-side mixin."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from weightsync_core.api.config import BUILT_SETTINGS, DELTA_HELD, CheckpointEngineConfig
from weightsync_core.api.engine import (
    CheckpointEngine,
    CheckpointEngineWithCache,
    SyncProgress,
    TransferStats,
)
from weightsync_core.api.errors import EmptyWeightsError, WeightSyncError
from weightsync_core.api.options import parse_options
from weightsync_core.api.plugins import load_custom_backend_module
from weightsync_core.api.protocols import ServerAdapter
from weightsync_core.api.registry import CheckpointEngineRegistry
from weightsync_core.data.bucketing import (
    WeightsSource,
    iter_named_tensors,
    iter_named_tensors_sync,
)
from weightsync_core.data.delta import DeltaPlan, DeltaReceiver, DeltaSender, SpreadDeltaSender
from weightsync_core.data.shards.specs import LayoutSpec, weights_spec
from weightsync_core.data.verification import ManifestGuard
from weightsync_core.net.blocking import run_blocking

__all__ = [
    "ActorCheckpointEngineMixin",
    "CheckpointEngineWorker",
    "build_engine",
    "built_settings",
    "check_on_this_machine",
    "close_engine",
]

logger = logging.getLogger(__name__)

_BLOCKING_METHODS = frozenset({"init_process_group", "finalize", "abort"})


AdapterT = TypeVar("AdapterT")


def build_engine(config: CheckpointEngineConfig) -> CheckpointEngine:
    """Import ``custom_backend_module`` in this process (under the operator's allowlist,
    this process's and the one the config carries from the driver), check what depends on
    this machine, then build the configured engine.

    ``rollout_dtype`` (when set), ``verify`` and ``timeout`` go to engines whose constructor
    takes them; an engine written for verl, which knows none of them, gets only
    ``bucket_size`` and its ``engine_kwargs`` and then, unless it set one of its own, the
    sync's timeout as its ``timeout`` attribute (what the helpers it uses wait at most).

    Raises:
        PluginError: a ``custom_backend_module`` refused or not loadable.
        EngineOptionsError: an option this machine cannot honour (a ``host`` that is no
            address of it, see :meth:`~weightsync_core.api.options.EngineOptions.check_local`).
        ValueError: buckets that cannot fit in this machine's memory.
    """
    load_custom_backend_module(config.custom_backend_module, config.trusted_modules)
    engine_cls = CheckpointEngineRegistry.get(config.backend)
    check_on_this_machine(engine_cls, config)
    options = {"verify": config.verify, "timeout": config.sync_timeout_seconds}
    if config.rollout_dtype is not None:
        options["rollout_dtype"] = config.rollout_torch_dtype  # verl's take a dtype
    engine = engine_cls(
        bucket_size=config.bucket_size_bytes,
        **_accepted(engine_cls, options),
        **config.active_engine_kwargs,
    )
    if _written_for_verl(engine) and "timeout" not in vars(engine):
        engine.timeout = config.sync_timeout_seconds
    return engine


def built_settings(config: CheckpointEngineConfig, engine: CheckpointEngine) -> dict[str, Any]:
    """What travels as ``engine`` was built from ``config`` in this process
    (:meth:`~weightsync_core.api.config.CheckpointEngineConfig.travel_settings`, from the engine's
    own options where it has them): what a worker answers a sync's
    :data:`~weightsync_core.api.config.BUILT_SETTINGS` call with, which the manager compares
    with its own config before any byte moves."""
    engine_cls = type(engine)
    options = getattr(engine, "options", None) if engine_cls.declares_options() else None
    return config.travel_settings(engine_cls, options)


def check_on_this_machine(
    engine_cls: type[CheckpointEngine], config: CheckpointEngineConfig
) -> None:
    """What the driver cannot check for this process, checked in it before its engine is
    built (before any byte moves): that the address it binds is one of this machine's
    (its options' :meth:`~weightsync_core.api.options.EngineOptions.check_local`) and that its
    buckets fit in this machine's memory
    (:meth:`~weightsync_core.api.config.CheckpointEngineConfig.check_bucket_memory`). An
    engine written for verl (no typed options) has its buckets checked only.

    Raises:
        EngineOptionsError: the address cannot be bound here.
        ValueError: the buckets cannot fit here.
    """
    if engine_cls.declares_options():
        parse_options(engine_cls.options_class, config.backend,
                      config.active_engine_kwargs).check_local(config.backend)
    config.check_bucket_memory(engine_cls)


def close_engine(engine: Any) -> None:
    """Release what an engine about to be replaced holds (its group, transport threads,
    listening sockets), if it has a ``close`` (an engine written for verl may not). Left to
    the garbage collector, a replaced engine keeps them for as long as anything refers to
    it, and a transport's destructor then runs wherever the last reference goes. A failure
    to close is logged: the engine is dropped either way."""
    close = getattr(engine, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception:
        logger.warning("closing the replaced %s failed", type(engine).__name__, exc_info=True)


def _accepted(engine_cls: type[CheckpointEngine], options: dict[str, Any]) -> dict[str, Any]:
    """The ``options`` that ``engine_cls``'s constructor takes."""
    parameters = inspect.signature(engine_cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return options
    return {name: value for name, value in options.items() if name in parameters}


async def _execute(engine: CheckpointEngine, method: str, kwargs: dict[str, Any]) -> Any:
    if method.startswith("_") or not hasattr(engine, method):
        raise AttributeError(f"{type(engine).__name__} has no public method {method!r}")
    function = getattr(engine, method)
    if method in _BLOCKING_METHODS:
        return await run_blocking(function, **kwargs)
    result = function(**kwargs)
    return await result if inspect.isawaitable(result) else result


def _written_for_verl(engine: CheckpointEngine) -> bool:
    """Whether ``engine`` is an engine written for verl (own constructor, no typed
    options), which keeps none of weightsync's engines' guarantees about aborts and the
    memory of what it yields."""
    return not type(engine).declares_options()


async def _engine_after_abort(
    engine: CheckpointEngine, config: CheckpointEngineConfig
) -> CheckpointEngine:
    """Abort ``engine`` after a failed sync; returns the engine to use from now on.

    An engine written for verl without an ``abort`` of its own only has its ``finalize``,
    which may keep state of the failed sync (verl's NIXL engine keeps the failed sync's
    queued messages and notifications, and every later sync fails on them): it is
    finalized as far as it goes and replaced by a new one built from ``config``."""
    if not (_written_for_verl(engine) and type(engine).abort is CheckpointEngine.abort):
        await run_blocking(engine.abort)
        return engine
    with contextlib.suppress(Exception):  # half-used: whatever it cannot release is dropped
        await run_blocking(engine.finalize)
    return build_engine(config)


async def _owned_copies(
    weights: AsyncIterator[tuple[str, torch.Tensor]],
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """``weights`` as tensors of their own (an engine written for verl yields views of its
    buffers, which its next bucket overwrites while the server may still hold them)."""
    async for name, tensor in weights:
        yield name, tensor.clone()


async def _deliver(
    adapter: ServerAdapter | None,
    weights: AsyncIterator[tuple[str, torch.Tensor]],
    global_steps: int | None,
    guard: ManifestGuard,
    progress: SyncProgress,
) -> TransferStats:
    """Feed received weights to ``adapter`` while counting them and checking each against
    the previous sync's (``guard``: a changed tensor is refused before the server sees it;
    an empty stream fails); check the adapter consumed them all. The stream becomes the
    guard's reference only when the adapter returned without error."""
    if adapter is None:
        raise WeightSyncError(
            "this worker has no server adapter to load weights into; pass server_adapter= or "
            "set self.server_adapter before the first sync"
        )
    stats = TransferStats()
    exhausted = False

    async def counted() -> AsyncIterator[tuple[str, torch.Tensor]]:
        nonlocal exhausted
        progress.enter("receiving")
        async for name, tensor in weights:
            guard.check(name, tensor)
            stats.num_tensors += 1
            stats.nbytes += tensor.numel() * tensor.element_size()
            progress.enter("loading")
            yield name, tensor
            progress.tensors += 1
            progress.enter("receiving")
        guard.finish()
        exhausted = True

    loop = asyncio.get_running_loop()
    start = loop.time()
    progress.tensors = 0
    try:
        await adapter.update_weights(counted(), global_steps=global_steps)
    finally:
        progress.enter("idle")
    if not exhausted:
        raise WeightSyncError(
            f"{type(adapter).__name__}.update_weights returned after {stats.num_tensors} "
            "tensors without consuming the whole stream; it must iterate every weight"
        )
    guard.accept()
    stats.seconds = loop.time() - start
    return stats


class _ProducedWeights:
    """The actor's weights as an engine takes them: with ``async for`` (weightsync's
    engines) or with a plain ``for`` (engines written for verl iterate so on their
    non-sending ranks, to drive the trainer's gathers). Either way every tensor is
    validated, counted in ``taken`` (the stats of an engine whose ``send_weights`` returns
    none) and noted in ``progress``: ``producing`` while the engine waits for the iterator,
    ``sending`` while the iterator waits for the engine. Iterate it once.

    Args:
        weights: what the actor's ``iter_weights`` returned.
        progress: the engine's progress record.
        taken: counts of what the engine took.
        contiguous: hand every tensor contiguous, as verl's weight exporters do (engines
            written for verl view them flat: verl's Mooncake engine fails on a transposed
            tensor otherwise).
    """

    def __init__(self, weights: WeightsSource, progress: SyncProgress, taken: TransferStats,
                 contiguous: bool = False):
        self.weights = weights
        self.progress = progress
        self.taken = taken
        self.contiguous = contiguous

    def __aiter__(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        return self._produce_async()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._produce_sync()

    async def _produce_async(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        self._start()
        try:
            async for name, tensor in iter_named_tensors(self.weights):
                yield self._taken(name, tensor)
                self._done_with_one()
        finally:
            self.progress.enter("idle")

    def _produce_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._start()
        try:
            for name, tensor in iter_named_tensors_sync(self.weights):
                yield self._taken(name, tensor)
                self._done_with_one()
        finally:
            self.progress.enter("idle")

    def _start(self) -> None:
        self.progress.tensors = 0
        self.progress.enter("producing")

    def _taken(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        self.progress.enter("sending")
        self.taken.num_tensors += 1
        self.taken.nbytes += tensor.numel() * tensor.element_size()
        return name, tensor.contiguous() if self.contiguous else tensor

    def _done_with_one(self) -> None:
        self.progress.tensors += 1
        self.progress.enter("producing")


class CheckpointEngineWorker:
    """Rollout-side Ray actor: owns an engine and hands received weights to the server.

    Use as ``ray.remote(CheckpointEngineWorker).remote(config, server_adapter)``. The adapter
    (or a subclass that sets ``self.server_adapter``) receives ``update_weights(weights_iter,
    global_steps)``. ``custom_backend_module`` is imported in this process before the
    backend is resolved.

    Attributes:
        weights_version: ``global_steps`` of the last complete update (``None`` before one).
        update_complete: False while an update is running or after one failed part-way.
    """

    def __init__(
        self, config: CheckpointEngineConfig, server_adapter: ServerAdapter | None = None
    ) -> None:
        self.config = config
        self.checkpoint_engine = build_engine(config)
        self.server_adapter = server_adapter
        self.weights_version: int | None = None
        self.update_complete = True
        self.manifest_guard = ManifestGuard()
        self.delta_receiver = DeltaReceiver()

    def server_adapter_of(self, kind: type[AdapterT]) -> AdapterT:
        """This worker's server adapter, which must be a ``kind``.

        Raises:
            TypeError: it is something else (or there is none), naming both.
        """
        adapter = self.server_adapter
        if not isinstance(adapter, kind):
            raise TypeError(f"{type(self).__name__} works through a {kind.__name__}, but its "
                            f"server adapter is {type(adapter).__name__}")
        return adapter

    async def execute_checkpoint_engine(self, method: str, **kwargs: Any) -> Any:
        """Run one engine method (``prepare``, ``init_process_group``, ``finalize``, ...);
        :data:`~weightsync_core.api.config.BUILT_SETTINGS` answers what this process's engine
        was built with (:func:`built_settings`), :data:`~weightsync_core.api.config.DELTA_HELD`
        the delta version this worker holds a copy of."""
        if method == "abort" and not kwargs:
            self.checkpoint_engine = await _engine_after_abort(self.checkpoint_engine,
                                                               self.config)
            return None
        if method == BUILT_SETTINGS and not kwargs:
            return built_settings(self.config, self.checkpoint_engine)
        if method == DELTA_HELD and not kwargs:
            return {"version": self.delta_receiver.version, "needs_base": False}
        if method == "prepare":
            self._declare_layout()
        return await _execute(self.checkpoint_engine, method, kwargs)

    def _declare_layout(self) -> None:
        """Hand the engine what this worker's server needs (its adapter's optional
        ``weight_layout()``: a :data:`~weightsync_core.data.shards.LayoutSpec`, None for every
        tensor whole) where the engine delivers layouts. An adapter whose
        ``takes_whole_weights`` is true (a vLLM tensor-parallel worker, whose loaders keep
        its shard of a whole tensor) receives every tensor whole from other engines.

        Raises:
            WeightSyncError: the server needs only part of the weights, but the engine
                delivers every tensor whole.
        """
        declare = getattr(self.server_adapter, "weight_layout", None)
        layout = declare() if declare is not None else None
        engine = self.checkpoint_engine
        if getattr(engine, "executes_layouts", False):
            engine.declare_layout(layout)
        elif layout is not None and not getattr(self.server_adapter, "takes_whole_weights",
                                                False):
            raise WeightSyncError(
                f"{type(self.server_adapter).__name__} needs only part of the weights (its "
                f"weight_layout() is {layout!r}), but backend {self.config.backend!r} delivers "
                "every tensor whole; use backend 'gloo_sharded', 'nixl_sharded' or "
                "'mooncake_sharded'")

    async def update_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        delta_base: str | None = None, delta_version: str | None = None,
    ) -> dict[str, float]:
        """Receive one version of the weights and load it into the server. Unless
        ``allow_manifest_change``, a tensor whose name, shape or dtype differs from the
        previous update's is refused (:class:`~weightsync_core.api.errors.ManifestChangedError`).

        ``delta_version`` (a delta-enabled sync, from the manager): keep a host copy of what
        arrives as that version; with ``delta_base``, what arrives are patches against the
        version of that token, which this worker must hold
        (:class:`~weightsync_core.data.delta.DeltaReceiver`)."""
        engine = self.checkpoint_engine
        plan = DeltaPlan.from_arguments(delta_base, delta_version)
        weights = self.delta_receiver.stream(engine.receive_weights(global_steps), plan,
                                             in_place=self._patchable_weights(plan))
        stats = await self._load(weights, global_steps, allow_manifest_change)
        if plan is not None:
            stats.update(self.delta_receiver.last_stats.as_dict())
        return stats

    async def update_weights_from_cache(
        self, global_steps: int | None = None, allow_manifest_change: bool = False
    ) -> dict[str, float]:
        """Load the actor side's cached latest weights (engines with a cache only)."""
        engine = self.checkpoint_engine
        if not isinstance(engine, CheckpointEngineWithCache):
            raise WeightSyncError(
                f"backend {self.config.backend!r} keeps no cache of the latest weights; "
                "new replicas get them from the next update_weights"
            )
        self.delta_receiver.forget()
        return await self._load(engine.get_weights(), global_steps, allow_manifest_change)

    async def _load(
        self, weights: AsyncIterator[tuple[str, torch.Tensor]], global_steps: int | None,
        allow_manifest_change: bool,
    ) -> dict[str, float]:
        self.update_complete = False
        self.manifest_guard.start(allow_change=allow_manifest_change)
        if _written_for_verl(self.checkpoint_engine):
            weights = _owned_copies(weights)
        stats = await _deliver(self.server_adapter, weights, global_steps, self.manifest_guard,
                               self.checkpoint_engine.progress)
        self.update_complete = True
        self.weights_version = global_steps
        return stats.as_dict()

    def _patchable_weights(self, plan: DeltaPlan | None) -> Mapping[str, torch.Tensor] | None:
        """The server's own tensors a delta-enabled sync may patch in place (its adapter's
        optional ``patchable_weights()``), for a full sync of such a ``plan``; else None."""
        offer = getattr(self.server_adapter, "patchable_weights", None)
        if plan is None or plan.is_delta or offer is None:
            return None
        return offer()

    def weights_status(self) -> dict[str, Any]:
        """``{"version": ..., "complete": ..., "delta_version": ..., "delta_kept_bytes":
        ...}`` of the weights this worker serves (``delta_version``: the token of the
        version it holds a copy of for delta syncs, or None; ``delta_kept_bytes``: the size
        of the copies it keeps itself, the server's tensors patched in place not counted)."""
        return {"version": self.weights_version, "complete": self.update_complete,
                "delta_version": self.delta_receiver.version,
                "delta_kept_bytes": self.delta_receiver.kept_bytes}

    async def _adapter_call(self, method: str) -> None:
        function = getattr(self.server_adapter, method, None)
        if function is not None:
            result = function()
            if inspect.isawaitable(result):
                await result

    async def abort_all_requests(self) -> None:
        """Forward to the server adapter, if it implements it."""
        await self._adapter_call("abort_all_requests")

    async def release_kv_cache(self) -> None:
        """Forward to the server adapter, if it implements it."""
        await self._adapter_call("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        """Forward to the server adapter, if it implements it."""
        await self._adapter_call("resume_kv_cache")

    async def resume_generation(self) -> None:
        """Forward to the server adapter, if it implements it."""
        await self._adapter_call("resume_generation")

    async def sleep(self) -> None:
        """Forward to the server adapter, if it implements it."""
        await self._adapter_call("sleep")

    async def wake_up(self) -> None:
        """Forward to the server adapter, if it implements it."""
        await self._adapter_call("wake_up")


class ActorCheckpointEngineMixin:
    """Gives an ``actor_wg`` worker (the training side) a checkpoint engine.

    Subclasses implement :meth:`iter_weights` (full tensors one by one) and call
    :meth:`init_checkpoint_engine`. In colocated mode (``naive``) pass the in-process
    ``server_adapter``; the actor then also loads the weights into it.
    """

    checkpoint_engine: CheckpointEngine
    colocated_server_adapter: ServerAdapter | None = None
    colocated_manifest_guard: ManifestGuard
    checkpoint_engine_config: CheckpointEngineConfig

    def init_checkpoint_engine(
        self, config: CheckpointEngineConfig, server_adapter: ServerAdapter | None = None,
        delta_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Build this process's engine (importing ``custom_backend_module`` first); an
        engine built before is closed first.

        ``delta_group``: the ``torch.distributed`` group of the actor's ranks, where each
        rank's :meth:`iter_weights` yields the same full tensors in step (an FSDP actor's
        gathers): in a delta sync each rank then keeps and diffs only its slice of every
        tensor (:class:`~weightsync_core.data.delta.SpreadDeltaSender`) instead of the sending
        rank keeping the whole model. Ignored by engines whose ranks each send their own
        share (they keep only that already)."""
        close_engine(getattr(self, "checkpoint_engine", None))
        self.checkpoint_engine = build_engine(config)
        self.checkpoint_engine_config = config
        self.colocated_server_adapter = server_adapter
        self.colocated_manifest_guard = ManifestGuard()
        spread = (delta_group is not None and dist.get_world_size(delta_group) > 1
                  and not self.checkpoint_engine.encodes_own_share)
        self.delta_sender = SpreadDeltaSender(delta_group) if spread else DeltaSender()

    def iter_weights(self) -> WeightsSource:
        """The weights to send: ``(name, full tensor)`` pairs, one at a time."""
        raise NotImplementedError(f"{type(self).__name__} must implement iter_weights()")

    def _check_engine_built(self, method: str) -> None:
        """Raise where :meth:`init_checkpoint_engine` has not run on this worker.

        Raises:
            WeightSyncError: naming this worker's class, ``method`` and the call to make.
        """
        missing = [name for name in ("checkpoint_engine", "checkpoint_engine_config",
                                     "colocated_manifest_guard", "delta_sender")
                   if not hasattr(self, name)]
        if missing:
            raise WeightSyncError(
                f"{type(self).__name__}.{method}() needs this actor worker's checkpoint "
                f"engine, but init_checkpoint_engine() has not run on it (it has no "
                f"{', '.join(missing)}): call self.init_checkpoint_engine(config) where the "
                "worker is set up, before the first sync"
            )

    async def execute_checkpoint_engine(self, method: str, **kwargs: Any) -> Any:
        """Run one engine method (``prepare``, ``init_process_group``, ``finalize``, ...);
        :data:`~weightsync_core.api.config.BUILT_SETTINGS` answers what this process's engine
        was built with (:func:`built_settings`), :data:`~weightsync_core.api.config.DELTA_HELD`
        the delta version this rank holds a copy of (:meth:`delta_held`)."""
        self._check_engine_built("execute_checkpoint_engine")
        if method == "abort" and not kwargs:
            self.checkpoint_engine = await _engine_after_abort(
                self.checkpoint_engine, self.checkpoint_engine_config
            )
            return None
        if method == BUILT_SETTINGS and not kwargs:
            return built_settings(self.checkpoint_engine_config, self.checkpoint_engine)
        if method == DELTA_HELD and not kwargs:
            return self.delta_held()
        engine = self.checkpoint_engine
        if method == "prepare" and getattr(engine, "executes_layouts", False):
            engine.declare_layout(self.weight_layout(), weights_spec(self.weight_shapes()))
        return await _execute(engine, method, kwargs)

    def delta_held(self) -> dict[str, Any]:
        """This rank's answer to :data:`~weightsync_core.api.config.DELTA_HELD`: the version of
        its delta copy (None: none), and whether a sync can send patches only where this
        rank holds their base: it sends (asked after ``init_process_group``, which gives it
        its role) or keeps a slice of a copy spread over the actor's ranks."""
        sender = self.delta_sender
        return {"version": sender.version,
                "needs_base": (self.checkpoint_engine.sends_weights()
                               or isinstance(sender, SpreadDeltaSender))}

    def weight_layout(self) -> LayoutSpec | None:
        """What this rank holds, for engines that deliver layouts (``gloo_sharded``): a
        :data:`~weightsync_core.data.shards.LayoutSpec` such as
        :func:`~weightsync_core.data.shards.fsdp_spec` (then :meth:`iter_weight_shards` yields
        those pieces), or None (the default): every tensor whole, as :meth:`iter_weights`
        yields them."""
        return None

    def weight_shapes(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor's full shape and dtype, in stream order, for engines that deliver
        layouts (the driver plans with them before any weight is read)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement weight_shapes() (every tensor's full shape "
            "and dtype, in stream order) for a backend that delivers layouts")

    def iter_weight_shards(self) -> WeightsSource:
        """The pieces :meth:`weight_layout` declares, ``(name, piece)`` in stream order (an
        FSDP rank: its local rows, gathered from no one)."""
        raise NotImplementedError(
            f"{type(self).__name__} declares a weight_layout(), so it must implement "
            "iter_weight_shards() (the pieces it holds, in stream order)")

    async def update_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        delta_base: str | None = None, delta_version: str | None = None,
    ) -> dict[str, float]:
        """Send this rank's weights (and, colocated, load them into the local server, where
        ``allow_manifest_change`` applies as on :class:`CheckpointEngineWorker`).

        ``delta_version`` (a delta-enabled sync, from the manager): where this rank sends
        (:meth:`~weightsync_core.api.engine.CheckpointEngine.sends_weights`), keep a host copy of
        what it sends as that version; with ``delta_base``, send patches against the version
        of that token (:class:`~weightsync_core.data.delta.DeltaSender`)."""
        self._check_engine_built("update_weights")
        engine = self.checkpoint_engine
        taken = TransferStats()
        plan = DeltaPlan.from_arguments(delta_base, delta_version)
        encoding = plan is not None and engine.sends_weights()
        source = (self.iter_weight_shards() if getattr(engine, "executes_layouts", False)
                  and self.weight_layout() is not None else self.iter_weights())
        weights = self.delta_sender.encoded(
            engine, _ProducedWeights(source, engine.progress, taken,
                                     contiguous=_written_for_verl(engine)),
            plan, self.checkpoint_engine_config.rollout_torch_dtype, encoding)
        stats = await engine.send_weights(weights, global_steps)
        if not isinstance(stats, TransferStats):  # an engine written for verl returns None
            if not taken.num_tensors:  # it would only end the sync, blaming the receivers
                raise EmptyWeightsError(
                    "the weight stream of this actor rank held no tensors; a sync that loads "
                    "nothing is refused (does iter_weights yield anything?)"
                )
            stats = taken
            bucket_size = getattr(engine, "bucket_size", 0)
            if isinstance(bucket_size, int) and bucket_size > 0:  # at least this many
                stats.num_buckets = -(-taken.nbytes // bucket_size)
        if engine.is_colocated:
            guard = self.colocated_manifest_guard
            guard.start(allow_change=allow_manifest_change)
            stats = await _deliver(
                self.colocated_server_adapter, engine.receive_weights(global_steps), global_steps,
                guard, engine.progress,
            )
        result = stats.as_dict()
        if encoding:
            result.update(self.delta_sender.last_stats.as_dict())
        if plan is not None:
            result["delta_kept_bytes"] = float(self.delta_sender.kept_bytes)
        return result
