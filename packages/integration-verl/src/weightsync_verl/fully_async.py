"""verl's fully-async trainer (``verl.experimental.fully_async_policy``) on weightsync.

verl 0.9.1's ``FullyAsyncTrainer`` builds verl's own ``CheckpointEngineManager`` whatever
``actor_rollout_ref.rollout.checkpoint_manager_class`` says, and its rollouter builds
replicas whose workers load each update as it arrives. Run instead::

    python -m weightsync_verl.fully_async <verl's fully-async overrides> \\
        actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync_gloo \\
        actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync_verl

(the same Hydra config and overrides as ``python -m
verl.experimental.fully_async_policy.fully_async_main``). Its trainer builds the manager
``checkpoint_manager_class`` names, weightsync's (:class:`~weightsync_verl.CheckpointEngineManager`)
where it names none, and its rollouter's replicas stage
(:func:`~weightsync_verl.staging.use_staging_replicas`): the trainer's
``_fit_update_weights`` then moves each version into a stage on every rollout worker while
the replicas keep generating, and pauses each (verl's ``abort_all_requests``, a partial
rollout) only to load its stage. A LoRA policy's replicas are verl's own, loading each
adapter under a short pause (:func:`replicas_stage`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import hydra
import ray
from verl.experimental.fully_async_policy import (
    fully_async_main,
    fully_async_rollouter,
    fully_async_trainer,
)
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import load_class_from_fqn

from weightsync_verl.lora import trains_unmerged_lora
from weightsync_verl.manager import CheckpointEngineManager
from weightsync_verl.staging import use_staging_replicas

__all__ = [
    "FullyAsyncRollouter",
    "FullyAsyncTaskRunner",
    "FullyAsyncTrainer",
    "checkpoint_manager_class",
    "main",
]

_CONFIG_NAME = "fully_async_ppo_trainer"
"""verl's Hydra config of the fully-async trainer."""


def _made_from(actor_class: Any) -> Any:
    """The class Ray actor class ``actor_class`` was made from (verl's are decorated with
    ``@ray.remote``, which a subclass must not inherit)."""
    return actor_class.__ray_actor_class__


def _actor_options(actor_class: Any) -> dict[str, Any]:
    """The options ``@ray.remote`` gave Ray actor class ``actor_class`` (verl's CPUs)."""
    return dict(actor_class._default_options)  # where Ray keeps them


_VerlTrainer = _made_from(fully_async_trainer.FullyAsyncTrainer)
_VerlRollouter = _made_from(fully_async_rollouter.FullyAsyncRollouter)
_VerlTaskRunner = _made_from(fully_async_main.FullyAsyncTaskRunner)


def checkpoint_manager_class(rollout_config: Any) -> type:
    """The checkpoint manager class verl's rollout config ``rollout_config`` names in
    ``checkpoint_manager_class`` (loaded as verl's other trainers load it), weightsync's
    :class:`~weightsync_verl.CheckpointEngineManager` where it names none."""
    name = rollout_config.get("checkpoint_manager_class")
    if not name:
        return CheckpointEngineManager
    return load_class_from_fqn(name, "CheckpointEngineManager")


class FullyAsyncTrainer(_VerlTrainer):
    """verl's ``FullyAsyncTrainer`` whose checkpoint manager is
    :func:`checkpoint_manager_class`'s."""

    async def _setup_checkpoint_manager(self) -> None:
        """Build the manager over verl's actor worker group and the rollouter's replicas."""
        rollout = self.config.actor_rollout_ref.rollout
        replicas = await self.rollouter.get_replicas.remote()
        manager_class = checkpoint_manager_class(rollout)
        self.checkpoint_manager = manager_class(
            config=omega_conf_to_dataclass(rollout.checkpoint_engine), actor_wg=self.actor_wg,
            replicas=replicas)
        print(f"[weightsync] fully-async trainer: {manager_class.__module__}."
              f"{manager_class.__name__} (backend={rollout.checkpoint_engine.backend})")


class FullyAsyncRollouter(_VerlRollouter):
    """verl's ``FullyAsyncRollouter`` whose replicas' workers stage
    (:class:`~weightsync_verl.staging.StagingCheckpointEngineWorker`), except for a LoRA
    policy (:func:`replicas_stage`)."""

    async def init_workers(self) -> None:
        """verl's, with the rollout's replica class made to stage first (not for a LoRA
        policy)."""
        if replicas_stage(self.config):
            use_staging_replicas(self.config.actor_rollout_ref.rollout.name)
        else:
            print("[weightsync] fully-async rollouter: a LoRA policy's replicas load each "
                  "adapter under a short pause (staged LoRA syncs are not built)")
        await super().init_workers()


def replicas_stage(config: Any) -> bool:
    """Whether the fully-async rollouter of verl config ``config`` builds staging replicas:
    yes, unless the policy is an unmerged LoRA one, whose syncs (base once, then the
    adapter: :mod:`weightsync_verl.lora`) staging workers refuse; its replicas are verl's
    own, each sync's adapter loaded under a pause as short as the adapter is small."""
    return not trains_unmerged_lora(config.actor_rollout_ref.model)


_TrainerActor = ray.remote(**_actor_options(fully_async_trainer.FullyAsyncTrainer))(
    FullyAsyncTrainer)
_RollouterActor = ray.remote(**_actor_options(fully_async_rollouter.FullyAsyncRollouter))(
    FullyAsyncRollouter)


class FullyAsyncTaskRunner(_VerlTaskRunner):
    """verl's ``FullyAsyncTaskRunner`` creating :class:`FullyAsyncTrainer` and
    :class:`FullyAsyncRollouter` (verl's runner names its classes as globals of its module:
    they are replaced there while it creates them, in the runner's own process)."""

    def _create_trainer(self, config: Any) -> None:
        with _replaced(fully_async_main, FullyAsyncTrainer=_TrainerActor):
            super()._create_trainer(config)

    def _create_rollouter(self, config: Any) -> None:
        with _replaced(fully_async_main, FullyAsyncRollouter=_RollouterActor):
            super()._create_rollouter(config)


_TaskRunnerActor = ray.remote(**_actor_options(fully_async_main.FullyAsyncTaskRunner))(
    FullyAsyncTaskRunner)


@contextlib.contextmanager
def _replaced(module: ModuleType, **names: Any) -> Iterator[None]:
    """``module``'s globals ``names`` set to the values given, restored after."""
    saved = {name: getattr(module, name) for name in names}
    for name, value in names.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def main() -> None:
    """verl's fully-async entry point (its Hydra config and overrides, its checks) with
    :class:`FullyAsyncTaskRunner`."""
    # verl's entry finds its config beside its own file only when run as a script
    config_dir = Path(fully_async_main.__file__).parent / "config"
    entry = hydra.main(config_path=str(config_dir), config_name=_CONFIG_NAME,
                       version_base=None)(fully_async_main.main.__wrapped__)
    with _replaced(fully_async_main, FullyAsyncTaskRunner=_TaskRunnerActor):
        entry()


if __name__ == "__main__":
    main()
