"""Ray actors used by the conformance suite and the benchmarks.

``WeightSourceActor`` plays an ``actor_wg`` rank holding deterministic weights;
``RecordingRolloutWorker`` is a :class:`CheckpointEngineWorker` whose server records a digest
of every received tensor (and can be told to stall or die).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import torch

from weightsync_core.api.config import CheckpointEngineConfig
from weightsync_core.data.adapters import AdapterSpec
from weightsync_core.data.bucketing import WeightsSource
from weightsync_core.data.shards.experts import (
    fsdp_first_expert,
    fused_experts,
    per_expert_shapes,
    per_expert_stream,
)
from weightsync_core.data.shards.layout import fsdp_layout
from weightsync_core.data.shards.specs import LayoutSpec, resolve_layout
from weightsync_core.testing.replay import tap_control_frames
from weightsync_core.testing.resources import process_resources
from weightsync_core.testing.weights import (
    Faults,
    TensorDigest,
    convert_in_place,
    digest,
    faulty_stream,
    make_adapter,
    make_weights,
    sparse_updates,
)
from weightsync_core.worker import ActorCheckpointEngineMixin, CheckpointEngineWorker

__all__ = [
    "RecordingRolloutWorker",
    "RecordingServerAdapter",
    "WeightSourceActor",
    "corrupt_bucket_checksum",
    "fail_engine_call",
    "lie_in_prepare",
]

_TRUTH: Any = object()
"""``lie_in_prepare``'s ``instead`` when the engine's own metadata is kept."""


def lie_in_prepare(
    engine: Any, drop: Sequence[str] = (), update: dict[str, Any] | None = None,
    instead: Any = _TRUTH,
) -> None:
    """Make ``engine.prepare()`` return wrong metadata from now on (a process that lies to
    the topology): its own without the keys in ``drop`` and with ``update`` merged in, or
    ``instead`` (anything: a string, None, another dict) in its place. With none of them,
    the engine's own ``prepare`` is restored. The engine's ``prepare`` still runs (what it
    reserves is reserved); only what it returns changes."""
    vars(engine).pop("prepare", None)
    if not drop and not update and instead is _TRUTH:
        return
    true_prepare = engine.prepare

    def prepare() -> Any:
        metadata = true_prepare()
        if instead is not _TRUTH:
            return instead
        return {**{k: v for k, v in metadata.items() if k not in drop}, **(update or {})}

    engine.prepare = prepare


def corrupt_bucket_checksum(engine: Any, bucket: int | None) -> None:
    """From now on, have ``engine`` (a sending engine) announce a wrong checksum for the
    ``bucket``-th bucket it packs (its bytes and its checksum disagree, as after corruption
    in memory or on the wire); ``None`` restores the engine's own checksum."""
    vars(engine).pop("bucket_checksum", None)
    if bucket is None:
        return
    true_checksum, calls = engine.bucket_checksum, itertools.count()

    def corrupted(data: Any) -> int:
        value = true_checksum(data)
        return value ^ 1 if next(calls) == bucket else value

    engine.bucket_checksum = corrupted


def fail_engine_call(engine: Any, method: str | None) -> None:
    """Make ``engine.<method>()`` raise a ``RuntimeError`` naming it from now on (a process
    whose engine fails at one step); ``None`` restores every method this made fail."""
    for name in [name for name, value in vars(engine).items()
                 if getattr(value, "fails_on_purpose", False)]:
        del vars(engine)[name]
    if method is None:
        return

    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError(f"{method} failed on purpose")

    fail.fails_on_purpose = True  # pyright: ignore[reportFunctionMemberAccess]
    setattr(engine, method, fail)


class _ProcessHooks:
    """What tests ask of any process of a deployment: its resources, and faults of its
    engine (``checkpoint_engine``) and its control traffic."""

    checkpoint_engine: Any

    def resources(self) -> dict[str, object]:
        """What this process holds (see :func:`process_resources`)."""
        return process_resources()

    def tap_control_frames(self, path: str | None) -> None:
        """Record every control frame this process sends (see
        :func:`~weightsync_core.testing.replay.tap_control_frames`)."""
        tap_control_frames(path)

    def lie_in_prepare(
        self, drop: Sequence[str] = (), update: dict[str, Any] | None = None,
        instead: Any = _TRUTH,
    ) -> None:
        """Make this process's engine return wrong metadata from ``prepare()`` (see
        :func:`lie_in_prepare`); with no argument, its own again."""
        lie_in_prepare(self.checkpoint_engine, drop, update, instead)

    def fail_engine_call(self, method: str | None) -> None:
        """Make this process's engine raise from ``method`` (see :func:`fail_engine_call`);
        ``None``: behave again."""
        fail_engine_call(self.checkpoint_engine, method)


class RecordingServerAdapter:
    """A stand-in inference server that keeps a digest of each received tensor.

    ``die_after`` / ``stall_after``: after that many tensors, kill this process or wait
    forever (simulating a crashed or hung inference server). ``refuse_after``: after that
    many tensors, raise once (a server that refuses one load, and takes the next);
    ``refuse_stage_after``: the same in :meth:`check_staged_weight` (a stage refused);
    with ``hold_stage_refusal``, that refusal waits for :attr:`stage_refusal_released` (a
    test lets another replica's stage complete first).
    ``delay_per_tensor``: seconds to spend on each tensor (a slow server). These act where
    the tensors arrive: in ``update_weights``, and, in a staged sync, in
    :meth:`check_staged_weight` as they are staged (``refuse_after`` only in the load: the
    commit). ``keep``: hold on
    to every received tensor, across updates, like a server that adopts the engine's tensors
    as its parameters; :meth:`changed_kept_tensors` tells which of them were overwritten
    since.
    ``convert``: change every received tensor in place once its digest is taken, as a server
    that converts weights while loading them does (what it keeps is the converted tensor).

    LoRA adapters: :attr:`adapters` holds the digests of every version it was given and did
    not drop; ``max_adapter_rank`` refuses adapters of a higher rank (as vLLM's
    ``max_lora_rank``), ``refuse_adapter`` its next adapter load.
    """

    def __init__(self) -> None:
        self.received: dict[str, TensorDigest | None] = {}
        self.global_steps: list[int | None] = []
        self.lifecycle: list[str] = []
        self.die_after: int | None = None
        self.stall_after: int | None = None
        self.refuse_after: int | None = None
        self.refuse_stage_after: int | None = None
        self.hold_stage_refusal = False
        self.stage_refusal_released = asyncio.Event()
        self.staged_count = 0
        """Tensors staged so far in the current stage."""
        self.delay_per_tensor = 0.0
        self.discard = False
        self.keep = False
        self.convert = False
        self.kept: dict[tuple[int | None, str], tuple[torch.Tensor, TensorDigest | None]] = {}
        self.layout: LayoutSpec | None = None
        self.adapters: dict[str, dict[int, dict[str, TensorDigest]]] = {}
        self.max_adapter_rank: int | None = None
        self.refuse_adapter = False

    def weight_layout(self) -> LayoutSpec | None:
        """What this server needs of the weights (None: every tensor whole)."""
        return self.layout

    def check_adapter(self, spec: AdapterSpec) -> None:
        """Refuse an adapter of a rank above :attr:`max_adapter_rank`."""
        if self.max_adapter_rank is not None and spec.rank > self.max_adapter_rank:
            raise ValueError(f"its max_lora_rank is {self.max_adapter_rank}")

    async def load_adapter(self, spec: AdapterSpec, version: int,
                           tensors: dict[str, torch.Tensor]) -> None:
        """Keep the digests of ``version`` of adapter ``spec.name`` (refused once where
        :attr:`refuse_adapter`)."""
        if self.refuse_adapter:
            self.refuse_adapter = False
            raise ValueError(f"the server refused version {version} of {spec.name!r}")
        self.adapters.setdefault(spec.name, {})[version] = {
            name: digest(tensor) for name, tensor in tensors.items()}

    def drop_adapter(self, name: str, version: int) -> None:
        """Forget ``version`` of adapter ``name``."""
        del self.adapters[name][version]

    async def _arrival_faults(self, count: int) -> None:
        """Die, stall or go slow at the ``count``-th tensor of a sync, as set."""
        if self.die_after is not None and count >= self.die_after:
            os._exit(1)
        if self.stall_after is not None and count >= self.stall_after:
            await asyncio.sleep(3600)
        if self.delay_per_tensor:
            await asyncio.sleep(self.delay_per_tensor)

    async def check_staged_weight(self, name: str, tensor: torch.Tensor) -> None:
        """A staged tensor arrives: the faults of arrival act here (see the class)."""
        if self.refuse_stage_after is not None and self.staged_count >= self.refuse_stage_after:
            self.refuse_stage_after = None
            if self.hold_stage_refusal:
                self.hold_stage_refusal = False
                await self.stage_refusal_released.wait()
            raise ValueError(f"the server refused staged tensor {name!r}")
        await self._arrival_faults(self.staged_count)
        self.staged_count += 1

    async def update_weights(
        self, weights: AsyncIterator[tuple[str, torch.Tensor]], global_steps: int | None = None
    ) -> None:
        received: dict[str, TensorDigest | None] = {}
        async for name, tensor in weights:
            if self.refuse_after is not None and len(received) >= self.refuse_after:
                self.refuse_after = None
                raise ValueError(f"the server refused tensor {name!r}")
            await self._arrival_faults(len(received))
            received[name] = None if self.discard else digest(tensor)
            if self.convert:
                convert_in_place(tensor)
            if self.keep:
                self.kept[(global_steps, name)] = (
                    tensor, digest(tensor) if self.convert else received[name])
        self.received = received
        self.global_steps.append(global_steps)

    def changed_kept_tensors(self) -> list[str]:
        """``"<global_steps>/<name>"`` of kept tensors whose bytes changed after arrival."""
        return [f"{steps}/{name}" for (steps, name), (tensor, seen) in self.kept.items()
                if digest(tensor) != seen]

    async def abort_all_requests(self) -> None:
        self.lifecycle.append("abort_all_requests")

    async def release_kv_cache(self) -> None:
        self.lifecycle.append("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        self.lifecycle.append("resume_kv_cache")

    async def resume_generation(self) -> None:
        self.lifecycle.append("resume_generation")

    async def sleep(self) -> None:
        self.lifecycle.append("sleep")

    async def wake_up(self) -> None:
        self.lifecycle.append("wake_up")


class RecordingRolloutWorker(_ProcessHooks, CheckpointEngineWorker):
    """Rollout worker whose server adapter is a :class:`RecordingServerAdapter`."""

    def __init__(self, config: CheckpointEngineConfig) -> None:
        super().__init__(config, RecordingServerAdapter())

    def set_faults(
        self,
        die_after: int | None = None,
        stall_after: int | None = None,
        discard: bool = False,
        keep: bool = False,
        delay_per_tensor: float = 0.0,
        convert: bool = False,
        refuse_after: int | None = None,
        refuse_stage_after: int | None = None,
        hold_stage_refusal: bool = False,
        max_adapter_rank: int | None = None,
        refuse_adapter: bool = False,
    ) -> None:
        """Make the server die or stall after that many tensors (``None``: behave), refuse
        its next load after ``refuse_after`` tensors (its next stage after
        ``refuse_stage_after``; with ``hold_stage_refusal``, only once
        :meth:`release_stage_refusal` is called), take ``delay_per_tensor`` seconds per
        tensor, skip digests (``discard``), keep every tensor until the update ends
        (``keep``), or change each in place as it loads it (``convert``); refuse adapters
        above ``max_adapter_rank``, or its next adapter load (``refuse_adapter``)."""
        adapter = self._recorder()
        adapter.die_after = die_after
        adapter.stall_after = stall_after
        adapter.refuse_after = refuse_after
        adapter.refuse_stage_after = refuse_stage_after
        adapter.hold_stage_refusal = hold_stage_refusal
        adapter.stage_refusal_released.clear()
        adapter.delay_per_tensor = delay_per_tensor
        adapter.discard = discard
        adapter.keep = keep
        adapter.convert = convert
        adapter.max_adapter_rank = max_adapter_rank
        adapter.refuse_adapter = refuse_adapter
        if not keep:
            adapter.kept.clear()

    def release_stage_refusal(self) -> None:
        """Let a held stage refusal (``set_faults(hold_stage_refusal=True)``) happen."""
        self._recorder().stage_refusal_released.set()

    async def stage_weights(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """The worker's own, the server's count of staged tensors (for its faults) reset."""
        self._recorder().staged_count = 0
        return await super().stage_weights(*args, **kwargs)

    def set_layout(self, layout: LayoutSpec | None) -> None:
        """Make the server need only the boxes of ``layout`` (a tensor-parallel worker, say);
        None: every tensor whole."""
        self._recorder().layout = layout

    def report(self) -> dict[str, Any]:
        """What the server received, and this process's view of the backend."""
        adapter = self._recorder()
        return {
            "received": adapter.received,
            "global_steps": adapter.global_steps,
            "lifecycle": adapter.lifecycle,
            "changed_kept_tensors": adapter.changed_kept_tensors(),
            "adapters": adapter.adapters,
            "engine_class": type(self.checkpoint_engine).__module__ + "."
            + type(self.checkpoint_engine).__qualname__,
            "pid": os.getpid(),
        }

    def tamper_delta_baseline(self, name: str) -> None:
        """Flip one bit of this worker's copy of ``name`` for delta syncs (its copy then
        differs from the sender's, as after a bug or a bad memory cell)."""
        baseline = self.delta_receiver.baselines[name]
        baseline.reshape(-1).view(torch.uint8)[0] ^= 1

    def _recorder(self) -> RecordingServerAdapter:
        return self.server_adapter_of(RecordingServerAdapter)


class WeightSourceActor(_ProcessHooks, ActorCheckpointEngineMixin):
    """An ``actor_wg`` rank with deterministic weights; colocated engines also get a
    recording server in-process."""

    def __init__(self, config: CheckpointEngineConfig) -> None:
        self.config = config
        self.weights: dict[str, torch.Tensor] = {}
        self.faults = Faults()
        self.colocated_adapter = RecordingServerAdapter()
        self.weight_streams = 0
        self.layout: LayoutSpec | None = None
        self.adapter: AdapterSpec | None = None
        self.adapter_tensors: dict[str, torch.Tensor] = {}
        self.adapter_faults = Faults()
        self.init_checkpoint_engine(config, self.colocated_adapter)

    def set_weights(
        self, seed: int, profile: str = "standard", faults: Faults | None = None,
        updates: Sequence[tuple[int, float]] = (),
    ) -> int:
        """Regenerate the weights from ``seed``, then apply the sparse ``updates``
        (:func:`~weightsync_core.testing.weights.sparse_updates`); returns their total size
        in bytes."""
        self.weights = sparse_updates(
            make_weights(seed, self.config.bucket_size_bytes, profile), updates)
        self.faults = faults or Faults()
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    def set_adapter(self, spec: dict[str, Any], seed: int,
                    updates: Sequence[tuple[int, float]] = (),
                    faults: Faults | None = None) -> None:
        """Train the LoRA adapter ``spec`` (plain data), its tensors those of
        :func:`~weightsync_core.testing.weights.make_adapter` (``seed``, ``updates``)."""
        self.adapter = AdapterSpec.from_dict(spec)
        self.adapter_tensors = make_adapter(self.adapter, seed, updates=updates)
        self.adapter_faults = faults or Faults()

    def adapter_spec(self, name: str) -> AdapterSpec:
        if self.adapter is None or self.adapter.name != name:
            raise KeyError(f"this actor rank trains no adapter {name!r}")
        return self.adapter

    def iter_adapter_weights(self, name: str) -> WeightsSource:
        self.adapter_spec(name)
        return cast(WeightsSource, faulty_stream(self.adapter_tensors, self.adapter_faults))

    def set_uniform_weights(self, total_bytes: int, num_tensors: int) -> int:
        """Replace the weights by ``num_tensors`` equal float32 tensors (for benchmarks)."""
        numel = total_bytes // num_tensors // 4
        self.weights = {f"layer.{i}.weight": torch.rand(numel) for i in range(num_tensors)}
        self.faults = Faults()
        return numel * 4 * num_tensors

    def set_layout(self, layout: LayoutSpec | None) -> None:
        """Hold only the boxes of ``layout`` (an FSDP rank, say) for engines that deliver
        layouts; None: every tensor whole."""
        self.layout = layout

    def weight_layout(self) -> LayoutSpec | None:
        return self.layout

    def _declared(self) -> dict[str, torch.Tensor]:
        """The weights as this rank declares them (a ``reshape`` fault flattens one, as a
        change of layout would)."""
        return {name: tensor.reshape(-1) if name == self.faults.reshape else tensor
                for name, tensor in self.weights.items()}

    def _fused_experts(self) -> tuple[int, int] | None:
        """``(world_size, rank)`` where this rank holds fused experts as FSDP2 shards them
        and streams them per expert (an ``fsdp`` layout with ``fused_experts``)."""
        fsdp = (self.layout or {}).get("fsdp") or {}
        return (fsdp["world_size"], fsdp["rank"]) if fsdp.get("fused_experts") else None

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        shapes = {name: (tuple(tensor.shape), tensor.dtype)
                  for name, tensor in self._declared().items()}
        return per_expert_shapes(shapes) if self._fused_experts() else shapes

    def iter_weight_shards(self) -> WeightsSource:
        self.weight_streams += 1
        declared = self._declared()
        shapes = {name: tuple(tensor.shape) for name, tensor in declared.items()}
        if fused := self._fused_experts():
            # FSDP2's Shard(0) of every tensor, fused experts included (whole experts per
            # rank), their experts streamed one at a time, as views
            world_size, rank = fused
            rows = fsdp_layout(shapes, world_size, rank)
            first = fsdp_first_expert(fused_experts(shapes) or 0, world_size, rank)
            local = ((name, box.cut(declared[name])) for name, box in rows.boxes.items())
            shards = dict(per_expert_stream(local, first))
        else:
            held = resolve_layout(self.layout, shapes, "this actor rank")
            shards = {name: box.cut(declared[name]) for name, box in held.boxes.items()}
        return cast(WeightsSource, faulty_stream(shards, self.faults))

    def iter_weights(self) -> WeightsSource:
        self.weight_streams += 1
        # ``Faults.non_tensor`` makes the stream yield a non-tensor: on purpose, to test that
        # engines refuse it.
        return cast(WeightsSource, faulty_stream(self.weights, self.faults))

    def corrupt_checksum(self, bucket: int | None) -> None:
        """From now on, announce a wrong checksum for the ``bucket``-th bucket this rank
        packs (:func:`corrupt_bucket_checksum`); ``None`` restores the engine's own."""
        corrupt_bucket_checksum(self.checkpoint_engine, bucket)

    def report(self) -> dict[str, Any]:
        """What the colocated server received (colocated engines only)."""
        return {
            "received": self.colocated_adapter.received,
            "global_steps": self.colocated_adapter.global_steps,
            "adapters": self.colocated_adapter.adapters,
            "weight_streams": self.weight_streams,
            "delta_copies": sorted(self.delta_sender.baselines),
            "engine_class": type(self.checkpoint_engine).__module__ + "."
            + type(self.checkpoint_engine).__qualname__,
            "pid": os.getpid(),
        }
