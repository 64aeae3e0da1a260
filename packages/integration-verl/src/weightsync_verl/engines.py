"""weightsync backends as engines of verl's own ``CheckpointEngineRegistry``.

Each installed weightsync backend ``X`` is registered in verl as ``weightsync_X``: a thin
verl engine that owns the weightsync engine and forwards verl's calls to it. verl's manager
and workers drive it unchanged (verl gains verified delivery, timeouts, chunking of tensors
larger than a bucket, the CPU ``gloo`` backend); weightsync's manager drives it too (through
the extra methods it calls: session key, address, progress, abort, stats).

What verl's interface cannot say, the adapter fills in: verl's ``build_topology`` knows no
replicas, so every rollout worker counts as its own replica (kimi: every worker pulls); the
sync's session key is made in ``build_topology`` on verl's driver and reaches every process
through Ray with its ``init_process_group`` arguments.

Delta sync (``engine_kwargs: {weightsync_X: {delta: true}}``) needs no manager: each process
reports in ``prepare()`` the version it holds, ``build_topology`` agrees the sync's plan
(patches against that version where the sending rank and every rollout worker hold the same
one, else a full sync) and hands it to every process with its arguments.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from verl.checkpoint_engine import CheckpointEngine as VerlCheckpointEngine
from verl.checkpoint_engine import CheckpointEngineRegistry as VerlRegistry

from weightsync_core import (
    BackendState,
    CheckpointEngine,
    CheckpointEngineRegistry,
    SyncProgress,
    TransferStats,
    new_session_key,
)
from weightsync_core.data.quantization import FP8_BLOCK, QuantizedWeights, dequantized_stream
from weightsync_core.spi import (
    DeltaPlan,
    DeltaReceiver,
    DeltaSender,
    SpreadDeltaSender,
    WeightSyncError,
    parse_rollout_dtype,
)

__all__ = [
    "PREFIX",
    "WeightsyncCheckpointEngine",
    "register_backends",
    "verl_backend_name",
    "weightsync_backend_name",
]

PREFIX = "weightsync_"
"""verl's name of weightsync backend ``X`` is ``weightsync_X`` (verl's own ``nixl``,
``mooncake``, ``nccl`` keep their names)."""
LORA_HEADER = "weightsync_verl.lora_header."
"""The reserved prefix of the headers' names in a LoRA policy's sync
(:mod:`weightsync_verl.lora`)."""
_HELD = "delta_held"
_SPREAD = "delta_spread"
"""The key of the version a process holds in its ``prepare()`` metadata (delta sync)."""

def verl_backend_name(backend: str) -> str:
    """The name of weightsync backend ``backend`` in verl's registry."""
    return f"{PREFIX}{backend}"


def weightsync_backend_name(verl_backend: str) -> str:
    """The weightsync backend behind verl backend ``verl_backend`` (``weightsync_nixl`` ->
    ``nixl``).

    Raises:
        ValueError: ``verl_backend`` is not a weightsync backend's name in verl.
    """
    if not verl_backend.startswith(PREFIX) or verl_backend == PREFIX:
        raise ValueError(
            f"checkpoint_engine.backend={verl_backend!r} is not a weightsync backend: use "
            f"{PREFIX}<backend> (for example {PREFIX}nixl) with "
            "custom_backend_module=weightsync_verl"
        )
    return verl_backend.removeprefix(PREFIX)


class WeightsyncCheckpointEngine(VerlCheckpointEngine):
    """A weightsync engine behind verl's engine interface (subclassed per backend).

    Args:
        bucket_size: bytes per bucket (verl's ``update_weights_bucket_megabytes``).
        is_master: set by verl's actor rank 0; recorded by the weightsync engine.
        delta: delta sync (weightsync-core's ``CheckpointEngineConfig.delta``): after a
            full sync, only patches against the version every receiver holds travel,
            checked whole after apply. For backends whose engine ``supports_delta``.
        full_verify_every: with ``delta``, every Nth sync sends whole tensors (0: only
            where needed), as weightsync-core's ``CheckpointEngineConfig`` option.
        rollout_quantization: ``"fp8_block"``: each linear layer's weight travels as
            float8 with its block scales (half the bytes of bf16;
            :mod:`weightsync_core.data.quantization`), quantized on the actor rank, and the
            rollout worker hands verl's server the weights dequantized to ``rollout_dtype``
            (float32 where unset), as verl's servers load them: verl's own FP8 rollout
            (``rollout.quantization: fp8``) quantizes them again, to the very float8 bytes
            that travelled.
        **engine_kwargs: the weightsync backend's options (``engine_kwargs`` of the verl
            config), e.g. ``timeout``, ``verify``, ``rollout_dtype``, ``rebuild_group``.

    Raises:
        ValueError: ``delta`` for a backend that cannot move it, ``full_verify_every``
            without ``delta``, an unknown ``rollout_quantization`` or one for a backend that
            delivers layouts.
    """

    backend: ClassVar[str] = ""
    """The weightsync backend this class adapts."""

    def __init__(self, bucket_size: int, is_master: bool = False, delta: bool = False,
                 full_verify_every: int = 0, rollout_quantization: str | None = None,
                 **engine_kwargs: Any) -> None:
        if isinstance(full_verify_every, bool) or not isinstance(full_verify_every, int) or (
                full_verify_every < 0):
            raise ValueError(f"full_verify_every must be an integer >= 0 (0: only where "
                             f"needed), got {full_verify_every!r}")
        if full_verify_every and not delta:
            raise ValueError(
                f"full_verify_every={full_verify_every} applies to delta sync only, and delta "
                "is off (every sync is a full one already): set delta=True in the engine_kwargs "
                "as well, or drop full_verify_every"
            )
        self.bucket_size = bucket_size
        self.rollout_quantization = rollout_quantization
        self.rollout_dtype: torch.dtype | None = None
        """Where ``rollout_quantization`` is set: what travels unquantized is cast to, and
        what the rollout worker dequantizes into (the engine itself casts nothing then: the
        scales stay float32)."""
        if rollout_quantization is not None:
            if rollout_quantization != FP8_BLOCK:
                raise ValueError(f"rollout_quantization {rollout_quantization!r} is not known; "
                                 f"use {FP8_BLOCK!r} or leave it unset")
            if getattr(CheckpointEngineRegistry.get(self.backend), "executes_layouts", False):
                raise ValueError(
                    f"rollout_quantization: weightsync backend {self.backend!r} delivers "
                    "layouts, which verl's workers do not declare; use a full-copy backend "
                    "(weightsync_gloo, weightsync_nixl, weightsync_mooncake, weightsync_kimi)")
            self.rollout_dtype = parse_rollout_dtype(engine_kwargs.pop("rollout_dtype", None))
        self.engine: CheckpointEngine = CheckpointEngineRegistry.new(
            self.backend, bucket_size=bucket_size, is_master=is_master, **engine_kwargs
        )
        if delta and not type(self.engine).supports_delta:
            raise ValueError(
                f"delta=True: weightsync backend {self.backend!r} does not move delta syncs "
                "(its engine does not set supports_delta); drop delta from its engine_kwargs "
                "or use weightsync_gloo, weightsync_nixl, weightsync_mooncake or weightsync_kimi"
            )
        self.delta = delta
        self.full_verify_every = full_verify_every
        self.delta_sender: DeltaSender | None = None
        """Built at this process's first send (an actor rank's): :meth:`_actor_sender`."""
        self.delta_receiver = DeltaReceiver()
        self._plan: DeltaPlan | None = None
        self._stats = TransferStats()

    # -- verl's interface ----------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """The weightsync engine's metadata for the topology (with delta sync, and the
        version this process holds)."""
        metadata = self.engine.prepare()
        if self.delta:
            sender = self.delta_sender
            sent = sender.version if sender is not None else None
            held = sent or self.delta_receiver.version
            due = (sender is not None and self.full_verify_every > 0
                   and sender.deltas_since_full + 1 >= self.full_verify_every)
            # a sender due for a full sync reports no version: the plan is then a full one
            metadata = {**metadata, _HELD: None if due and sent else held,
                        _SPREAD: isinstance(sender, SpreadDeltaSender)}
        return metadata

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """The weightsync backend's topology (each rollout worker its own replica), plus a
        fresh session key for every process and, with delta sync, the sync's plan: patches
        against the version that the sending ranks (actor rank 0, or every actor rank where
        each sends its share) and every rollout worker reported, where they all hold the
        same one."""
        engine_cls = CheckpointEngineRegistry.get(cls.backend)
        held: list[str | None] | None = None
        if metadata and isinstance(metadata[0], dict) and _HELD in metadata[0]:
            # the ranks that keep the version: rank 0, or every actor rank where each sends
            # its share or keeps its slice of a copy spread over them
            spread = engine_cls.encodes_own_share or bool(metadata[0].get(_SPREAD))
            senders = actor_wg_world_size if spread else 1
            held = [m.get(_HELD) for m in (*metadata[:senders],
                                           *metadata[actor_wg_world_size:])]
            metadata = [{k: v for k, v in m.items() if k not in (_HELD, _SPREAD)}
                        for m in metadata]
        actor, rollout = engine_cls.build_replica_topology(
            actor_wg_world_size, [1] * rollout_world_size, metadata
        )
        key = new_session_key()
        actor = {**actor, "session_key": [key] * actor_wg_world_size}
        rollout = {**rollout, "session_key": [key] * rollout_world_size}
        if held is not None:
            plan = DeltaPlan.agreed(held)
            for side, size in ((actor, actor_wg_world_size), (rollout, rollout_world_size)):
                side["delta_base"] = [plan.base] * size
                side["delta_version"] = [plan.version] * size
        return actor, rollout

    def init_process_group(self, session_key: bytes | None = None,
                           delta_base: str | None = None, delta_version: str | None = None,
                           **kwargs: Any) -> None:
        """Join the sync (taking its session key when verl's manager drives it; weightsync's
        manager hands it over through :meth:`set_session_key` first) and its delta plan."""
        if session_key is not None:
            self.engine.set_session_key(session_key)
        self._plan = DeltaPlan.from_arguments(delta_base, delta_version)
        self.engine.init_process_group(**kwargs)

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Send; returns metrics for verl's trainer to log (``weightsync/...``), from a rank
        that sent tensors. A rank that only iterated (the trainer's gathers) returns none:
        verl's manager merges the ranks' metrics in rank order, and its zeros would replace
        the sender's counts. In a delta-enabled sync of an engine whose ranks each send
        their share (kimi), ``weightsync/share_bytes`` (what this rank's share sent),
        ``model_bytes`` and ``changed_fraction`` are this rank's, and there is no
        ``weightsync/bytes``."""
        plan = self._plan
        encoding = plan is not None and self.engine.sends_weights()
        sender = self._actor_sender()
        rollout_dtype = self.engine.rollout_dtype
        if self.rollout_quantization is not None:
            weights, rollout_dtype = QuantizedWeights(weights, self.rollout_dtype), None
        weights = sender.encoded(self.engine, weights, plan, rollout_dtype, encoding)
        self._stats = await self.engine.send_weights(weights, global_steps)
        if not self._stats.num_tensors:
            return {}
        metrics = {
            "weightsync/bytes": float(self._stats.nbytes),
            "weightsync/tensors": float(self._stats.num_tensors),
            "weightsync/buckets": float(self._stats.num_buckets),
            "weightsync/seconds/send": self._stats.seconds,
        }
        if plan is not None and encoding:
            stats = sender.last_stats
            metrics.update({
                "weightsync/delta": 1.0 if plan.is_delta else 0.0,
                "weightsync/model_bytes": float(stats.model_bytes),
                "weightsync/changed_fraction": stats.changed / max(stats.elements, 1),
            })
            if self.engine.encodes_own_share:
                # each rank knows only what its own share sent, and verl keeps the metrics
                # of the last rank: say so instead of the whole model's size
                del metrics["weightsync/bytes"]
                metrics["weightsync/share_bytes"] = float(stats.wire_bytes)
        return metrics

    def _actor_sender(self) -> DeltaSender:
        """This actor rank's delta sender, built at its first send: where verl's actor
        ranks form the default process group (FSDP: each iterates the same gathered
        tensors), a copy spread over them, each rank keeping its slice; else one whole copy
        on the sending rank (and, with kimi, each rank's share)."""
        if self.delta_sender is None:
            spread = (not self.engine.encodes_own_share and dist.is_available()
                      and dist.is_initialized() and dist.get_world_size() > 1)
            self.delta_sender = SpreadDeltaSender() if spread else DeltaSender()
        return self.delta_sender

    # verl annotates receive_weights as a coroutine returning a Generator; its engines (and
    # its CheckpointEngineWorker, which iterates with ``async for``) make it an async generator
    async def receive_weights(  # pyright: ignore[reportIncompatibleMethodOverride]
        self, global_steps: int | None = None, *, lora_sections: bool = False
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The weightsync engine's received tensors (with delta sync, whole tensors rebuilt
        from their patches; with ``rollout_quantization``, float8 weights dequantized), counted
        as they arrived for :meth:`transfer_stats`.

        A LoRA policy's sync (:mod:`weightsync_verl.lora`) carries headers between its
        sections, which only a receiver that splits them (``lora_sections``) may take.

        Raises:
            WeightSyncError: a LoRA sync arrived without ``lora_sections`` (a staging
                worker's receive, which does not split one).
        """
        self._stats = TransferStats()
        received = self._counted(self.delta_receiver.received(self.engine, global_steps,
                                                              self._plan))
        if self.rollout_quantization is not None:
            received = dequantized_stream(received, self.rollout_dtype or torch.float32)
        async for name, tensor in received:
            if name.startswith(LORA_HEADER) and not lora_sections:
                raise WeightSyncError(
                    "a LoRA policy's sync (base and adapter sections) arrived at a worker "
                    "that loads every tensor as a weight: staging workers "
                    "(StagingCheckpointEngineWorker, use_staging_replicas) do not take LoRA "
                    "syncs; use verl's CheckpointEngineWorker replicas for a LoRA policy")
            yield name, tensor

    async def _counted(self, received: AsyncIterator[tuple[str, torch.Tensor]]
                       ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """``received`` as it arrived, counted for :meth:`transfer_stats`."""
        async for name, tensor in received:
            self._stats.num_tensors += 1
            self._stats.nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def finalize(self) -> None:
        """End the sync."""
        self.engine.finalize()

    # -- what weightsync's manager calls besides ------------------------------------------
    def set_session_key(self, key: bytes) -> None:
        """Take the sync's session key (weightsync's manager)."""
        self.engine.set_session_key(key)

    def address(self) -> str:
        """Where this process runs (named when a sync fails)."""
        return self.engine.address()

    def sync_progress(self) -> dict[str, Any]:
        """What the engine waits for (for blame when a sync stalls)."""
        return self.engine.sync_progress()

    def abort(self) -> None:
        """Drop everything of a failed sync."""
        self.engine.abort()

    def close(self) -> None:
        """Release everything the engine holds, listening sockets included."""
        self.engine.close()

    @property
    def progress(self) -> SyncProgress:
        """The weightsync engine's progress, which the worker receiving through this engine
        updates (weightsync-core's rollout worker, in a staging verl worker)."""
        return self.engine.progress

    @classmethod
    def declares_options(cls) -> bool:
        """True: the engine behind takes typed options and keeps weightsync's guarantees
        (what it yields is the worker's own), which weightsync-core's rollout worker asks
        of the engine it receives through."""
        return True

    def transfer_stats(self) -> dict[str, float]:
        """What the last sync moved through this process (verl's workers discard it)."""
        return self._stats.as_dict()


def register_backends() -> list[str]:
    """Register every installed weightsync backend (except the colocated ``naive``: verl
    has its own) in verl's registry as ``weightsync_<name>``; returns the verl names. A
    backend whose package is installed but does not load is registered too: using it shows
    the load error."""
    names = []
    for backend, info in CheckpointEngineRegistry.available().items():
        if backend == "naive" or info.state is BackendState.NOT_INSTALLED:
            continue
        name = verl_backend_name(backend)
        if not _registered_in_verl(name):
            adapter = type(f"Weightsync{backend.title().replace('_', '')}CheckpointEngine",
                           (WeightsyncCheckpointEngine,), {"backend": backend,
                                                           "__module__": __name__})
            # verl's register is a plain function in the class body (no @staticmethod)
            VerlRegistry.register(name)(adapter)  # pyright: ignore[reportAttributeAccessIssue]
        names.append(name)
    return names


def _registered_in_verl(name: str) -> bool:
    try:
        VerlRegistry.get(name)
    except ValueError:
        return False
    return True
