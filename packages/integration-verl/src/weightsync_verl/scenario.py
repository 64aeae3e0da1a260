"""verl's checkpoint-engine correctness scenario on CPU, built from verl's own parts.

Written scenario for scenario from verl 0.9.1's ``tests/checkpoint_engine/test_utils.py``
and ``test_correctness_on_gpu.py`` (``test_nixl_checkpoint_engine`` with ``device="cpu"``):
trainer ranks in a verl ``RayWorkerGroup`` that create their engine from verl's registry
(``is_master`` on rank 0), verl's real ``CheckpointEngineWorker`` on the rollout side with a
recording server adapter, verl ``RolloutReplica`` objects slicing the rollout group, and a
checkpoint manager (verl's, or weightsync's through ``checkpoint_manager_class``). Where
verl's trainer wraps a model in FSDP on GPUs, this one holds a small Hugging Face model's
full state dict on every rank (what FSDP's per-tensor export yields), perturbed per step so
that every update carries new bytes.

Used by the package's tests and by ``weightsync-verl-bench``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from verl.checkpoint_engine import CheckpointEngine as VerlCheckpointEngine
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import split_resource_pool
from verl.utils.import_utils import import_external_libs, load_class_from_fqn
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
from verl.workers.rollout import BaseRollout, RolloutReplica

from weightsync_core import close_engine
from weightsync_core.data.quantization import QuantizedWeights, dequantized
from weightsync_core.spi import parse_rollout_dtype
from weightsync_verl.staging import StagingCheckpointEngineWorker

__all__ = [
    "RecordingCheckpointEngineWorker",
    "RecordingReplica",
    "StagingRecordingCheckpointEngineWorker",
    "TrainerWorker",
    "VerlCluster",
    "digest",
    "make_cluster",
    "make_manager",
    "make_rollout",
    "save_tiny_model",
]


# verl registers its dispatch modes at run time (``Dispatch`` is a ``DynamicEnum``), so they
# are looked up by name, which is how verl's own ``Dispatch[...]`` resolves them.
_ONE_TO_ALL = Dispatch["ONE_TO_ALL"]
_DP_COMPUTE = Dispatch["DP_COMPUTE"]


def digest(tensor: torch.Tensor) -> str:
    """Dtype, shape and bytes of ``tensor``, hashed."""
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{tensor.dtype}/{list(tensor.shape)}/{hashlib.sha256(data).hexdigest()}"


def save_tiny_model(
    directory: str | Path, hidden_size: int = 64, layers: int = 2, vocab_size: int = 1024
) -> str:
    """Save a small Qwen2 (float32, random weights) with ``save_pretrained``; return its path.
    ``hidden_size``, ``layers`` and ``vocab_size`` set its size."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 3,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(str(directory))
    return str(directory)


SYNTHETIC_TENSOR_MIB = 16
"""Size of each tensor of synthetic weights (``weights="synthetic:<MiB>"``)."""


def _load_weights(source: str) -> dict[str, torch.Tensor]:
    """A saved model's state dict (``source`` is its path), or ``synthetic:<MiB>``: that many
    MiB of float32 tensors of :data:`SYNTHETIC_TENSOR_MIB` each (for benchmarks)."""
    if source.startswith("synthetic:"):
        mib = int(source.removeprefix("synthetic:"))
        count, rest = divmod(mib, SYNTHETIC_TENSOR_MIB)
        sizes = [SYNTHETIC_TENSOR_MIB] * count + ([rest] if rest else [])
        generator = torch.Generator().manual_seed(0)
        return {f"layers.{index}.weight": torch.randn(size << 18, generator=generator)
                for index, size in enumerate(sizes)}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


class TrainerWorker(Worker):
    """A verl trainer rank holding a model's full state dict and a checkpoint engine from
    verl's registry (``is_master`` on rank 0, as verl's ``TrainingWorker``)."""

    def __init__(self, config: CheckpointEngineConfig, weights: str) -> None:
        super().__init__()
        # the trainer ranks' default process group, as verl's FSDP workers make (gloo on CPU)
        torch.distributed.init_process_group(backend="gloo", rank=self.rank,
                                             world_size=self.world_size)
        self.checkpoint_engine: VerlCheckpointEngine | None = None
        self.use_backend(config)
        self.weights = _load_weights(weights)

    @register(dispatch_mode=_ONE_TO_ALL)
    def use_backend(self, config: CheckpointEngineConfig) -> None:
        """Build the engine ``config`` names, as verl's ``TrainingWorker`` does at start-up
        (the previous engine, if any, is closed: a scenario runs several backends on one
        set of workers)."""
        close_engine(self.checkpoint_engine)
        import_external_libs(config.custom_backend_module or None)
        backend = _backend(config)
        engine_kwargs = dict(config.engine_kwargs.get(backend, {}) or {})
        if self.rank == 0:
            engine_kwargs["is_master"] = True
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, bucket_size=config.update_weights_bucket_megabytes << 20,
            **engine_kwargs,
        )

    @register(dispatch_mode=_ONE_TO_ALL)
    def perturb(self, step: int, fraction: float = 1.0) -> dict[str, str]:
        """Add step-seeded noise to every floating weight (the same on every rank; with
        ``fraction`` < 1 to about that fraction of each one's elements); return the digests
        the replicas must end up with."""
        generator = torch.Generator().manual_seed(step)
        for tensor in self.weights.values():
            if tensor.is_floating_point():
                noise = torch.randn(tensor.shape, generator=generator) * 1e-3
                if fraction < 1.0:
                    noise *= torch.rand(tensor.shape, generator=generator) < fraction
                tensor.add_(noise)
        return {name: digest(tensor) for name, tensor in self.weights.items()}

    @register(dispatch_mode=_ONE_TO_ALL)
    def quantized(self, rollout_dtype: str) -> dict[str, Any]:
        """What an ``fp8_block`` sync of the current weights moves (``nbytes``) and what a
        rollout worker then reports (``digests``: each weight as it travels quantized,
        dequantized to ``rollout_dtype``; the rest cast to it)."""
        dtype = parse_rollout_dtype(rollout_dtype)
        travelling = dict(QuantizedWeights(self.weights, dtype))
        return {"nbytes": sum(t.numel() * t.element_size() for t in travelling.values()),
                "digests": {name: digest(tensor) for name, tensor in
                            dequantized(travelling, dtype or torch.float32).items()}}

    @register(dispatch_mode=_ONE_TO_ALL)
    def delta_kept_bytes(self) -> int:
        """Bytes of the copy this rank's engine keeps for delta syncs (0 without one)."""
        sender = getattr(self.checkpoint_engine, "delta_sender", None)
        return sender.kept_bytes if sender is not None else 0

    @register(dispatch_mode=_ONE_TO_ALL)
    def nbytes(self) -> int:
        """Bytes of one copy of the weights."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.weights.values())

    @register(dispatch_mode=_ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        """As verl's workers: hand the per-tensor weights to the engine; return its
        metrics."""
        if self.checkpoint_engine is None:
            raise RuntimeError("this trainer rank has no checkpoint engine: use_backend() first")
        weights = ((name, tensor) for name, tensor in self.weights.items())
        metrics = await self.checkpoint_engine.send_weights(weights, global_steps=global_steps)
        return metrics or {}  # as verl's ActorRolloutRefWorker: verl's manager merges them

    @register(dispatch_mode=_DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call an engine method (verl's manager drives the engine through this)."""
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


def _backend(config: CheckpointEngineConfig) -> str:
    """The engine name ``config`` sets (verl's config allows none)."""
    if not config.backend:
        raise ValueError("verl's CheckpointEngineConfig names no backend: set backend=")
    return config.backend


_LOADS_KEPT = 4
"""How many loads a :class:`RecordingServerAdapter` keeps the record of."""


class RecordingServerAdapter(BaseRollout):
    """verl's rollout interface, recording what each update delivered (digests)."""

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig) -> None:
        # verl annotates device_mesh as a DeviceMesh; a rollout without one on CPU passes None
        super().__init__(config, model_config, device_mesh=None)  # pyright: ignore[reportArgumentType]
        self.received: dict[str, str] = {}
        self.global_steps: list[int | None] = []
        self.loads: list[dict[str, Any]] = []
        """With ``recording``, the last loads: their tensors' digests and the ``peft_config``
        and ``base_sync_done`` it came with (a LoRA policy's sync loads in sections)."""
        self.recording = True
        """Off, updates are consumed without digests (benchmarks time the transfer)."""
        self.refusing = 0
        """The next updates to fail part-way (after their first tensor), a server that cannot
        load what it was given."""

    async def resume(self, tags: list[str]) -> None:
        """Nothing is released."""

    async def release(self) -> None:
        """Nothing to release."""

    # verl annotates weights as a Generator; its CheckpointEngineWorker passes the engine's
    # async iterator
    async def update_weights(  # pyright: ignore[reportIncompatibleMethodOverride]
        self, weights: AsyncIterator[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors", **kwargs: Any,
    ) -> None:
        """Digest every received tensor (only count them, with ``recording`` off); while
        :attr:`refusing`, fail after the first tensor, which is then held."""
        received = self.received if self.refusing else {}
        async for name, tensor in weights:
            received[name] = digest(tensor) if self.recording else ""
            if self.refusing:
                self.refusing -= 1
                raise RuntimeError("the server refused the update (the scenario's fault)")
        self.received = received
        self.global_steps.append(kwargs.get("global_steps"))
        if self.recording:
            load = {"tensors": dict(received), "peft_config": kwargs.get("peft_config"),
                    "base_sync_done": kwargs.get("base_sync_done")}
            self.loads = [*self.loads[-_LOADS_KEPT + 1:], load]


class _Recording:
    """A verl rollout worker with a :class:`RecordingServerAdapter` (mixed into verl's
    ``CheckpointEngineWorker`` and weightsync-verl's staging one)."""

    server_adapter: Any
    checkpoint_engine: Any

    def __init__(self, rollout_config: RolloutConfig, model_config: HFModelConfig) -> None:
        adapter = RecordingServerAdapter(rollout_config, model_config)
        super().__init__(rollout_config, model_config, adapter)  # pyright: ignore[reportCallIssue]

    @register(dispatch_mode=_ONE_TO_ALL)
    def use_backend(self, config: CheckpointEngineConfig) -> None:
        """Build the engine ``config`` names, as verl's ``CheckpointEngineWorker`` does at
        start-up (closing the previous one)."""
        close_engine(self.checkpoint_engine)
        import_external_libs(config.custom_backend_module or None)
        backend = _backend(config)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, bucket_size=config.update_weights_bucket_megabytes << 20,
            **(config.engine_kwargs.get(backend, {}) or {}),
        )

    @register(dispatch_mode=_ONE_TO_ALL)
    def set_recording(self, recording: bool) -> None:
        """Digest received tensors (``True``) or only consume them."""
        self._recorder().recording = recording

    @register(dispatch_mode=_ONE_TO_ALL)
    def report(self) -> dict[str, Any]:
        """What the server holds (digests per tensor), and the versions it loaded."""
        recorder = self._recorder()
        return {"received": recorder.received, "global_steps": recorder.global_steps,
                "loads": recorder.loads}

    def refuse_updates(self, count: int = 1) -> None:
        """Make the server fail its next ``count`` loads part-way."""
        self._recorder().refusing = count

    def _recorder(self) -> RecordingServerAdapter:
        adapter = self.server_adapter
        if not isinstance(adapter, RecordingServerAdapter):
            raise TypeError(
                f"{type(self).__name__} records through a RecordingServerAdapter, not a "
                f"{type(adapter).__name__}"
            )
        return adapter


class RecordingCheckpointEngineWorker(_Recording, CheckpointEngineWorker):
    """verl's ``CheckpointEngineWorker`` with a :class:`RecordingServerAdapter`."""


class StagingRecordingCheckpointEngineWorker(_Recording, StagingCheckpointEngineWorker):
    """weightsync-verl's :class:`~weightsync_verl.staging.StagingCheckpointEngineWorker`
    with a :class:`RecordingServerAdapter`."""


class RecordingReplica(RolloutReplica):
    """A replica over a slice of the rollout worker group (verl's test ``MockReplica``)."""

    async def init_hybrid(self, worker_group: RayWorkerGroup) -> None:
        """Take this replica's workers from ``worker_group``."""
        start = self.world_size * self.replica_rank
        self.workers = worker_group.workers[start:start + self.world_size]

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        raise NotImplementedError("the scenario's replicas serve no HTTP")

    async def launch_servers(self) -> None:
        raise NotImplementedError("the scenario's replicas serve no HTTP")


@dataclass
class VerlCluster:
    """The trainer group, the rollout group and its replicas of one scenario.

    (A ``RayWorkerGroup`` binds its workers' ``@register`` methods at run time, which verl's
    types do not say: hence the ``pyright: ignore`` on those calls.)
    """

    config: CheckpointEngineConfig
    actor_wg: RayWorkerGroup
    rollout: RayWorkerGroup
    replicas: list[RecordingReplica]
    pool: RayResourcePool

    def shutdown(self) -> None:
        """Kill every worker and give the CPUs of the resource pool back to Ray."""
        for worker in [*self.actor_wg.workers, *self.rollout.workers]:
            ray.kill(worker)
        for group in self.pool.pgs or []:
            ray.util.remove_placement_group(group)

    def use_backend(self, config: CheckpointEngineConfig) -> None:
        """Rebuild every worker's engine for ``config`` (one set of workers, several
        backends)."""
        self.actor_wg.use_backend(config)  # pyright: ignore[reportAttributeAccessIssue]
        self.rollout.use_backend(config)  # pyright: ignore[reportAttributeAccessIssue]
        self.config = config

    def perturb(self, step: int, fraction: float = 1.0) -> dict[str, str]:
        """New weights on every trainer rank (about ``fraction`` of each tensor's elements
        changed); returns what every replica must receive."""
        return self.actor_wg.perturb(step, fraction)[0]  # pyright: ignore[reportAttributeAccessIssue]

    def nbytes(self) -> int:
        """Bytes of one copy of the trainer's weights."""
        return self.actor_wg.nbytes()[0]  # pyright: ignore[reportAttributeAccessIssue]

    def quantized(self, rollout_dtype: str) -> dict[str, Any]:
        """What an ``fp8_block`` sync moves and every replica must report
        (:meth:`TrainerWorker.quantized`)."""
        return self.actor_wg.quantized(rollout_dtype)[0]  # pyright: ignore[reportAttributeAccessIssue]

    def delta_kept_bytes(self) -> list[int]:
        """Per trainer rank: the bytes its engine keeps for delta syncs."""
        return self.actor_wg.delta_kept_bytes()  # pyright: ignore[reportAttributeAccessIssue]

    def reports(self) -> list[dict[str, Any]]:
        """Per rollout worker: what arrived (see :meth:`RecordingCheckpointEngineWorker.report`)."""
        return self.rollout.report()  # pyright: ignore[reportAttributeAccessIssue]


def make_cluster(
    config: CheckpointEngineConfig, model_path: str, num_trainer: int = 2,
    num_rollout: int = 6, replica_size: int = 2, weights: str | None = None,
    staging: bool = False,
) -> VerlCluster:
    """The scenario's worker groups on CPU (Ray must be running with enough CPUs).
    ``model_path``: a saved Hugging Face model (its config is the rollout's model config);
    the trainer ranks send its weights, or ``weights`` (``synthetic:<MiB>``) if given.
    ``staging``: the rollout workers stage (weightsync-verl's staging worker)."""
    pool = RayResourcePool(process_on_nodes=[num_trainer + num_rollout], use_gpu=False,
                           max_colocate_count=1)
    trainer_pool, rollout_pool = split_resource_pool(pool, [num_trainer, num_rollout])
    actor_wg = RayWorkerGroup(
        resource_pool=trainer_pool, device_name="cpu",
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainerWorker), config=config,
                                               weights=weights or model_path),
    )
    rollout, replicas = make_rollout(config, model_path, rollout_pool, replica_size, staging)
    return VerlCluster(config, actor_wg, rollout, replicas, pool)


def make_rollout(
    config: CheckpointEngineConfig, model_path: str, pool: RayResourcePool, replica_size: int,
    staging: bool = False,
) -> tuple[RayWorkerGroup, list[RecordingReplica]]:
    """verl ``CheckpointEngineWorker``s (recording what arrives; ``staging``: weightsync-
    verl's staging ones), one per process of ``pool``, and the replicas of ``replica_size``
    workers they form."""
    worker_class = (StagingRecordingCheckpointEngineWorker if staging
                    else RecordingCheckpointEngineWorker)
    model_config = HFModelConfig(path=model_path, load_tokenizer=False)
    rollout_config = RolloutConfig(name="vllm", checkpoint_engine=config,
                                   tensor_model_parallel_size=replica_size)
    rollout = RayWorkerGroup(
        resource_pool=pool, device_name="cpu",
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(worker_class),
                                               rollout_config=rollout_config,
                                               model_config=model_config),
    )
    replicas = [RecordingReplica(replica_rank=rank, config=rollout_config,
                                 model_config=model_config, gpus_per_node=replica_size)
                for rank in range(rollout.world_size // replica_size)]

    async def init() -> None:
        await asyncio.gather(*(replica.init_hybrid(rollout) for replica in replicas))

    asyncio.run(init())
    return rollout, replicas


def make_manager(cluster: VerlCluster, manager_class: str | None = None) -> Any:
    """verl's ``CheckpointEngineManager``, or the class named by ``manager_class`` (a dotted
    name, loaded as verl's trainer loads ``rollout.checkpoint_manager_class``)."""
    if manager_class is None:
        from verl.checkpoint_engine import CheckpointEngineManager as manager_cls
    else:
        manager_cls = load_class_from_fqn(manager_class, "CheckpointEngineManager")
    return manager_cls(config=cluster.config, actor_wg=cluster.actor_wg,
                       replicas=list(cluster.replicas))
