"""The actor side of a sync in one process: :class:`ActorCheckpointEngineMixin` gives an
``actor_wg`` worker its engine, its weight stream and the versions it holds for delta sync."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from weightsync_core.api.config import (
    ADAPTER_CHECK,
    ADAPTER_KEEP,
    ADAPTER_SPEC,
    BEGIN_SYNC,
    BUILT_SETTINGS,
    DELTA_HELD,
    CheckpointEngineConfig,
)
from weightsync_core.api.engine import (
    CheckpointEngine,
    SyncProgress,
    TransferStats,
)
from weightsync_core.api.errors import EmptyWeightsError, WeightSyncError
from weightsync_core.api.passes import passes_of
from weightsync_core.api.protocols import ServerAdapter
from weightsync_core.data.adapters import AdapterSpec
from weightsync_core.data.bucketing import (
    WeightsSource,
    iter_named_tensors,
    iter_named_tensors_sync,
)
from weightsync_core.data.delta import DeltaPlan, DeltaSender, SpreadDeltaSender
from weightsync_core.data.quantization import QuantizedWeights
from weightsync_core.data.shards.specs import LayoutSpec, weights_spec
from weightsync_core.data.verification import ManifestGuard
from weightsync_core.worker.adapters import RolloutAdapters
from weightsync_core.worker.delivery import deliver_weights
from weightsync_core.worker.lifecycle import (
    AbortGate,
    begin_sync,
    build_engine,
    built_settings,
    close_engine,
    engine_after_abort,
    execute_engine_method,
    written_for_verl,
)

__all__ = ["ActorCheckpointEngineMixin"]

logger = logging.getLogger(__name__)

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
        self._engine_aborts = AbortGate()
        self.checkpoint_engine_config = config
        self.colocated_server_adapter = server_adapter
        self.colocated_manifest_guard = ManifestGuard()
        spread = (delta_group is not None and dist.get_world_size(delta_group) > 1
                  and not self.checkpoint_engine.encodes_own_share)
        self.delta_sender = SpreadDeltaSender(delta_group) if spread else DeltaSender()
        self.adapter_delta_senders: dict[str, DeltaSender] = {}
        """Per LoRA adapter name, the copy its delta syncs are against (the sending rank's)."""
        self.colocated_adapters = RolloutAdapters()
        """With a colocated engine, the LoRA adapter versions the in-process server holds."""

    def iter_weights(self) -> WeightsSource:
        """The weights to send: ``(name, full tensor)`` pairs, one at a time."""
        raise NotImplementedError(f"{type(self).__name__} must implement iter_weights()")

    def adapter_spec(self, name: str) -> AdapterSpec:
        """The LoRA adapter ``name`` this rank trains, as adapter syncs describe it
        (:meth:`AdapterSpec.from_peft_config
        <weightsync_core.data.adapters.AdapterSpec.from_peft_config>` of its PEFT config)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement adapter_spec(name) (and "
            "iter_adapter_weights(name)) for adapter syncs")

    def iter_adapter_weights(self, name: str) -> WeightsSource:
        """Adapter ``name``'s tensors, ``(name, full tensor)`` as PEFT's
        ``get_peft_model_state_dict`` names them (``...q_proj.lora_A.weight``)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement iter_adapter_weights(name) (and "
            "adapter_spec(name)) for adapter syncs")

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

    async def _abort_engine(self) -> None:
        self.checkpoint_engine = await engine_after_abort(self.checkpoint_engine,
                                                          self.checkpoint_engine_config)

    async def execute_checkpoint_engine(self, method: str, **kwargs: Any) -> Any:
        """Run one engine method (``prepare``, ``init_process_group``, ``finalize``, ...);
        :data:`~weightsync_core.api.config.BUILT_SETTINGS` answers what this process's engine
        was built with (:func:`built_settings`),
        :data:`~weightsync_core.api.config.BEGIN_SYNC` begins a sync in one call
        (:func:`begin_sync`), :data:`~weightsync_core.api.config.DELTA_HELD`
        the delta version this rank holds a copy of (:meth:`delta_held`; with ``adapter``: of
        that adapter), :data:`~weightsync_core.api.config.ADAPTER_SPEC` the spec of the
        adapter ``name`` (:meth:`adapter_spec`)."""
        self._check_engine_built("execute_checkpoint_engine")
        if method == "abort" and not kwargs:
            await self._engine_aborts.run(self._abort_engine)
            return None
        await self._engine_aborts.settled()
        if method == BUILT_SETTINGS and not kwargs:
            return built_settings(self.checkpoint_engine_config, self.checkpoint_engine)
        if method == BEGIN_SYNC:
            return await begin_sync(self.execute_checkpoint_engine, lambda: built_settings(
                self.checkpoint_engine_config, self.checkpoint_engine), **kwargs)
        if method == DELTA_HELD and not kwargs:
            return self.delta_held()
        if method == DELTA_HELD and set(kwargs) == {"adapter"}:
            sender = self.adapter_delta_senders.get(kwargs["adapter"])
            return {"version": None if sender is None else sender.version,
                    "needs_base": self.checkpoint_engine.sends_weights()}
        if method == ADAPTER_SPEC:
            return self.adapter_spec(kwargs["name"]).as_dict()
        if method == ADAPTER_CHECK:  # a colocated engine: this rank's server is a replica's
            self.colocated_adapters.check(
                AdapterSpec.from_dict(kwargs["adapter"]), self.colocated_server_adapter,
                bool(kwargs.get("allow_change")), "this actor rank's colocated server")
            return None
        if method == ADAPTER_KEEP:
            await self.colocated_adapters.keep(self.colocated_server_adapter, kwargs["name"],
                                               kwargs["versions"])
            return None
        engine = self.checkpoint_engine
        if method == "prepare" and getattr(engine, "executes_layouts", False):
            adapter = kwargs.pop("adapter", None)
            if adapter is None:
                engine.declare_layout(self.weight_layout(), weights_spec(self.weight_shapes()),
                                      self.checkpoint_engine_config.rollout_quantization)
            else:  # an adapter goes whole, whatever this rank holds of the base
                engine.declare_layout(None, weights_spec(await self._adapter_shapes(adapter)))
        return await execute_engine_method(engine, method, kwargs)

    async def _adapter_shapes(self, name: str
                              ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor of adapter ``name``, its shape and dtype in stream order (read from
        :meth:`iter_adapter_weights`: an adapter sync through an engine that delivers
        layouts reads the adapter twice, once to plan)."""
        return {tensor_name: (tuple(tensor.shape), tensor.dtype)
                async for tensor_name, tensor in iter_named_tensors(
                    self.iter_adapter_weights(name))}

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
        adapter: dict[str, Any] | None = None,
    ) -> dict[str, float]:
        """Send this rank's weights (and, colocated, load them into the local server, where
        ``allow_manifest_change`` applies as on :class:`CheckpointEngineWorker`).

        ``delta_version`` (a delta-enabled sync, from the manager): where this rank sends
        (:meth:`~weightsync_core.api.engine.CheckpointEngine.sends_weights`), keep a host copy of
        what it sends as that version; with ``delta_base``, send patches against the version
        of that token (:class:`~weightsync_core.data.delta.DeltaSender`).

        ``adapter`` (an adapter sync: the spec the manager checked, as plain data): send
        that LoRA adapter's tensors (:meth:`iter_adapter_weights`), never quantized; a
        colocated engine's in-process server adds them as version ``global_steps`` beside
        the versions it serves (:attr:`colocated_adapters`)."""
        self._check_engine_built("update_weights")
        engine = self.checkpoint_engine
        passes = passes_of(engine)
        passes.clear()
        taken = TransferStats()
        plan = DeltaPlan.from_arguments(delta_base, delta_version)
        encoding = plan is not None and engine.sends_weights()
        rollout_dtype = self.checkpoint_engine_config.rollout_torch_dtype
        sender = self.delta_sender
        if adapter is not None:
            name = AdapterSpec.from_dict(adapter).name
            source = self.iter_adapter_weights(name)
            sender = self.adapter_delta_senders.setdefault(name, DeltaSender())
        else:
            source = (self.iter_weight_shards() if getattr(engine, "executes_layouts", False)
                      and self.weight_layout() is not None else self.iter_weights())
            if (self.checkpoint_engine_config.rollout_quantization is not None
                    and not getattr(engine, "quantizes_shards", False)):
                source, rollout_dtype = QuantizedWeights(source, rollout_dtype), None
        weights = sender.encoded(
            engine, _ProducedWeights(source, engine.progress, taken,
                                     contiguous=written_for_verl(engine)),
            plan, rollout_dtype, encoding)
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
        if engine.is_colocated and adapter is not None:
            if global_steps is None:
                raise WeightSyncError("an adapter sync needs a version: pass global_steps")
            received = await self.colocated_adapters.receive(
                engine, self.colocated_server_adapter, AdapterSpec.from_dict(adapter),
                global_steps, None)
            stats = TransferStats(int(received["num_tensors"]), int(received["nbytes"]), 0,
                                  received["seconds"])
        elif engine.is_colocated:
            guard = self.colocated_manifest_guard
            guard.start(allow_change=allow_manifest_change)
            stats = await deliver_weights(
                self.colocated_server_adapter, engine.receive_weights(global_steps), global_steps,
                guard, engine.progress, passes,
            )
        result = stats.as_dict()
        result.update(passes.as_dict())
        if encoding:
            result.update(sender.last_stats.as_dict())
        if plan is not None:
            result["delta_kept_bytes"] = float(sender.kept_bytes)
        return result
