"""verl's real actor worker group on CPU, built the way verl's trainers build it.

``RayPPOTrainer.init_workers`` (and the v1 and separation trainers) put verl's
``ActorRolloutRefWorker`` in a colocated worker class (``create_colocated_worker_cls``) and
``spawn`` the role's group from it: the actors expose the role's methods under prefixed
names (``actor_rollout_update_weights``). :func:`make_actor_group` does exactly that, with
verl's own configuration composed from its ``ppo_trainer`` defaults, and FSDP2 on the CPU.

Where verl itself cannot start on CPU, a stand-in takes its place, each named here:

- the platform: verl registers none for the CPU (:mod:`weightsync_verl.cpu_platform`,
  selected by :data:`CPU_WORKER_ENV`);
- the FSDP engine is registered for ``cuda`` and ``npu`` only: ``VERL_ENGINE_DEVICE=cuda``
  (verl's own override) selects it, and it runs on the CPU platform's devices;
- verl's worker asks torch for the process group ``cpu:gloo,cpu:gloo`` on CPU, which torch
  refuses: :class:`CpuActorRolloutRefWorker` creates the default group with gloo first;
- the in-process rollout of verl's naive hand-over needs vLLM or SGLang:
  :class:`RecordingRollout` (rollout ``name: cpu_recording``) records what it is handed.

:class:`CpuActorRolloutRefWorker` also has what a test needs around verl's worker: a new
checkpoint engine per backend, step-seeded changes of the weights, their digests, and a
sender failure injected into the next sync.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import DictConfig
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import create_colocated_worker_cls
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout import BaseRollout
from verl.workers.rollout.base import _ROLLOUT_REGISTRY

from weightsync_core import close_engine
from weightsync_verl.cpu_platform import PLATFORM
from weightsync_verl.scenario import digest

__all__ = [
    "CPU_WORKER_ENV",
    "RECORDING_ROLLOUT",
    "CpuActorRolloutRefWorker",
    "InjectedSenderFailure",
    "RecordingRollout",
    "make_actor_group",
    "verl_trainer_config",
]

CPU_WORKER_ENV: dict[str, str] = {
    "VERL_PLATFORM": PLATFORM,
    "VERL_USE_EXTERNAL_MODULES": "weightsync_verl.cpu_platform",
    "VERL_ENGINE_DEVICE": "cuda",
}
"""Environment of verl worker processes on CPU (see the module's stand-ins)."""

RECORDING_ROLLOUT = "cpu_recording"
"""``rollout.name`` of :class:`RecordingRollout`."""

_ONE_TO_ALL = Dispatch["ONE_TO_ALL"]


class InjectedSenderFailure(RuntimeError):
    """The failure :meth:`CpuActorRolloutRefWorker.fail_next_sync_after` injects."""


class RecordingRollout(BaseRollout):
    """The in-process rollout of verl's naive hand-over, recording the digests of what it
    is handed (verl's own rollouts need vLLM or SGLang)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        self.received: dict[str, str] = {}
        self.global_steps: list[int | None] = []

    async def resume(self, tags: list[str]) -> None:
        """Nothing was released."""

    async def release(self) -> None:
        """Nothing to release."""

    # verl annotates weights as a Generator and passes the engine's per-tensor export
    async def update_weights(  # pyright: ignore[reportIncompatibleMethodOverride]
        self, weights: Iterable[tuple[str, torch.Tensor]], **kwargs: Any
    ) -> None:
        """Digest every tensor handed over."""
        self.received = {name: digest(tensor) for name, tensor in weights}
        self.global_steps.append(kwargs.get("global_steps"))


# verl looks rollouts up by (name, mode) in this table, and has no public way to add one
_ROLLOUT_REGISTRY[(RECORDING_ROLLOUT, "async")] = f"{__name__}.RecordingRollout"


class CpuActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's ``ActorRolloutRefWorker`` on CPU, with what a test drives besides."""

    @register(dispatch_mode=_ONE_TO_ALL)
    def init_model(self) -> None:
        """verl's ``init_model``, after creating the default process group with gloo
        (verl's own request, ``cpu:gloo,cpu:gloo``, is refused by torch)."""
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(
                backend="gloo", rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
            )
        super().init_model()
        self._failure_after: int | None = None
        self._export = self._training_engine.get_per_tensor_param
        self._training_engine.get_per_tensor_param = self._per_tensor_param

    @property
    def _training_engine(self) -> Any:
        """This rank's verl training engine (FSDP2 here)."""
        if self.actor is None:
            raise RuntimeError("this worker has no actor: its role has none, or init_model() "
                               "has not run")
        return self.actor.engine

    @register(dispatch_mode=_ONE_TO_ALL)
    def use_backend(self, config: CheckpointEngineConfig) -> None:
        """A new checkpoint engine for ``config``, built as ``init_model`` builds it (the
        previous one closed): one set of workers runs several backends."""
        if not config.backend:
            raise ValueError("verl's CheckpointEngineConfig names no backend: set backend=")
        close_engine(getattr(self, "checkpoint_engine", None))
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend, is_master=torch.distributed.get_rank() == 0,
            bucket_size=config.update_weights_bucket_megabytes << 20,
            **(config.engine_kwargs.get(config.backend) or {}),
        )

    @register(dispatch_mode=_ONE_TO_ALL)
    def perturb(self, step: int, trainable_only: bool = False) -> None:
        """Add step-seeded noise to this rank's shard of every floating parameter (only of
        those that train, with ``trainable_only``: a LoRA policy's adapter)."""
        generator = torch.Generator().manual_seed(step * 1000 + torch.distributed.get_rank())
        with torch.no_grad():
            for parameter in self._training_engine.module.parameters():
                if trainable_only and not parameter.requires_grad:
                    continue
                local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
                if local.is_floating_point():
                    local.add_(torch.randn(local.shape, generator=generator) * 1e-3)

    @register(dispatch_mode=_ONE_TO_ALL)
    def weights(self) -> dict[str, Any]:
        """``{"digests": {name: digest}, "nbytes": bytes}`` of the full weights, as the
        engine exports them (every rank takes part in the gathers)."""
        exported, _ = self._export()
        return _digests(exported)

    @register(dispatch_mode=_ONE_TO_ALL)
    def adapter_weights(self) -> dict[str, Any]:
        """``{"digests": {name: digest}, "nbytes": bytes, "peft_config": {...}}`` of a LoRA
        policy's adapter, as the engine exports it once the base is in place."""
        exported, peft_config = self._export(base_sync_done=True)
        return {**_digests(exported), "peft_config": peft_config}

    @register(dispatch_mode=_ONE_TO_ALL)
    def fail_next_sync_after(self, tensors: int) -> None:
        """Make this rank's next export raise :class:`InjectedSenderFailure` after
        ``tensors`` tensors."""
        self._failure_after = tensors

    @register(dispatch_mode=_ONE_TO_ALL)
    def rollout_report(self) -> dict[str, Any]:
        """What the in-process :class:`RecordingRollout` was handed last, and the versions
        so far."""
        rollout = self.rollout
        if not isinstance(rollout, RecordingRollout):
            raise TypeError(f"this worker's rollout is a {type(rollout).__name__}, which "
                            f"records nothing: use rollout.name={RECORDING_ROLLOUT}")
        return {"received": rollout.received, "global_steps": rollout.global_steps}

    def _per_tensor_param(self, *args: Any, **kwargs: Any) -> tuple[Iterator[Any], Any]:
        exported, peft_config = self._export(*args, **kwargs)
        after, self._failure_after = self._failure_after, None
        return (exported if after is None else _failing(exported, after)), peft_config


def _digests(exported: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """``{"digests": {name: digest}, "nbytes": bytes}`` of ``exported`` tensors."""
    digests, nbytes = {}, 0
    for name, tensor in exported:
        digests[name] = digest(tensor)
        nbytes += tensor.numel() * tensor.element_size()
    return {"digests": digests, "nbytes": nbytes}


def _failing(exported: Iterator[Any], after: int) -> Iterator[Any]:
    """``exported``, raising :class:`InjectedSenderFailure` after ``after`` items."""
    for index, item in enumerate(exported):
        if index == after:
            raise InjectedSenderFailure(f"injected sender failure after {after} tensors")
        yield item


def verl_trainer_config(model_path: str | Path, checkpoint_engine: dict[str, Any],
                        world_size: int, overrides: Iterable[str] = ()) -> DictConfig:
    """verl's ``ppo_trainer`` configuration (its defaults, composed by Hydra as verl's
    ``main_ppo`` does) for a small run on CPU: ``model_path``'s model with FSDP2, the
    :class:`RecordingRollout`, ``world_size`` ranks, the ``checkpoint_engine`` settings
    given (``backend``, ``custom_backend_module``, ...) and further Hydra ``overrides``
    (``actor_rollout_ref.model.lora_rank=4``)."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    overrides = [
        f"actor_rollout_ref.model.path={model_path}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.rollout.name={RECORDING_ROLLOUT}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        *(f"actor_rollout_ref.rollout.checkpoint_engine.{key}={value}"
          for key, value in checkpoint_engine.items()),
        "data.train_batch_size=2",
        f"trainer.n_gpus_per_node={world_size}",
        "trainer.device=cpu",
        *overrides,
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def make_actor_group(
    config: DictConfig, pool: RayResourcePool, role: str = "actor_rollout"
) -> RayWorkerGroup:
    """verl's actor worker group for ``role`` on ``pool``, as ``RayPPOTrainer.init_workers``
    builds it (a colocated worker class, the role's group spawned from it), its models
    initialised (``init_model``)."""
    worker = RayClassWithInitArgs(cls=ray.remote(CpuActorRolloutRefWorker),
                                  config=config.actor_rollout_ref, role=role)
    colocated = create_colocated_worker_cls(class_dict={role: worker})
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=colocated, device_name="cpu",
                           worker_env=dict(CPU_WORKER_ENV))
    actor_wg = group.spawn(prefix_set={role})[role]
    actor_wg.init_model()  # pyright: ignore[reportAttributeAccessIssue]
    return actor_wg
