"""weightsync-trainer: a compact Ray RL trainer (GRPO / PPO) for Hugging Face causal LMs that
moves weights to its rollout replicas with weightsync checkpoint engines.

The training-side worker group is ``actor_wg``; extension points follow verl:
``actor_rollout_ref.rollout.checkpoint_manager_class``,
``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module``,
``TrainingWorkerConfig.extra_context`` (injected per role by a :class:`TaskRunner` subclass),
:class:`LLMServerClient` without a load balancer, and :class:`LLMServerManager` subclasses.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightsync_trainer.balancer import GlobalRequestLoadBalancer
    from weightsync_trainer.config import (
        ActorConfig,
        ActorRolloutRefConfig,
        AlgorithmConfig,
        CriticConfig,
        DataConfig,
        ExperimentConfig,
        ModelConfig,
        OptimConfig,
        RayInitConfig,
        RayKwargsConfig,
        RolloutConfig,
        TaskConfig,
        TrainerConfig,
        TrainingWorkerConfig,
    )
    from weightsync_trainer.config_loader import load_config
    from weightsync_trainer.errors import ConfigError, NoLoadBalancerError
    from weightsync_trainer.llm_server import (
        HFRolloutReplica,
        LLMServerClient,
        LLMServerManager,
        get_rollout_replica_class,
    )
    from weightsync_trainer.task_runner import TaskRunner
    from weightsync_trainer.trainer import RayPPOTrainer

# Exports are imported on first use, so that light processes (the load-balancer actor) do not
# pay for torch and transformers.
_EXPORTS = {
    "GlobalRequestLoadBalancer": "balancer",
    **dict.fromkeys(
        ["ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "CriticConfig",
         "DataConfig", "ExperimentConfig", "ModelConfig", "OptimConfig", "RayInitConfig",
         "RayKwargsConfig", "RolloutConfig", "TaskConfig", "TrainerConfig",
         "TrainingWorkerConfig"],
        "config",
    ),
    "load_config": "config_loader",
    "ConfigError": "errors",
    "NoLoadBalancerError": "errors",
    **dict.fromkeys(
        ["HFRolloutReplica", "LLMServerClient", "LLMServerManager", "get_rollout_replica_class"],
        "llm_server",
    ),
    "TaskRunner": "task_runner",
    "RayPPOTrainer": "trainer",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync_trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"weightsync_trainer.{module}"), name)


try:
    __version__ = version("weightsync-trainer")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "ExperimentConfig",
    "GlobalRequestLoadBalancer",
    "HFRolloutReplica",
    "LLMServerClient",
    "LLMServerManager",
    "ModelConfig",
    "NoLoadBalancerError",
    "OptimConfig",
    "RayInitConfig",
    "RayKwargsConfig",
    "RayPPOTrainer",
    "RolloutConfig",
    "TaskConfig",
    "TaskRunner",
    "TrainerConfig",
    "TrainingWorkerConfig",
    "__version__",
    "get_rollout_replica_class",
    "load_config",
]
