"""Configuration dataclasses of an experiment, validated on construction.

Defaults live in ``default.yaml`` next to this module; :mod:`weightsync_trainer.config_loader`
merges a user YAML file and ``a.b.c=value`` overrides into them and builds these classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weightsync_core import CheckpointEngineConfig
from weightsync_trainer.errors import ConfigError

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "ExperimentConfig",
    "ModelConfig",
    "OptimConfig",
    "RolloutConfig",
    "TaskConfig",
    "TrainerConfig",
    "TrainingWorkerConfig",
]

ALGORITHMS = ("grpo", "ppo")


def _positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"{owner}.{name} must be > 0, got {value!r}")


@dataclass
class ModelConfig:
    """The Hugging Face causal LM trained by the actor and served by the rollout.

    With ``path`` unset the model is built from ``model_type`` and the size fields (random
    initialisation from ``seed``, no download); with ``path`` set it is loaded with
    ``from_pretrained(path)`` and the size fields are ignored.
    """

    model_type: str = "llama"
    path: str | None = None
    vocab_size: int = 16
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        _positive(
            "model", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
        )
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) must be a multiple of "
                f"model.num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_key_value_heads ({self.num_key_value_heads})"
            )


@dataclass
class TaskConfig:
    """The synthetic task: reward = fraction of response tokens equal to ``target_token``."""

    prompt_length: int = 4
    response_length: int = 8
    target_token: int = 3

    def __post_init__(self) -> None:
        _positive("task", prompt_length=self.prompt_length,
                  response_length=self.response_length)
        if self.target_token < 0:
            raise ConfigError(f"task.target_token must be >= 0, got {self.target_token}")


@dataclass
class AlgorithmConfig:
    """Policy-gradient settings shared by GRPO and PPO.

    ``group_size`` responses are sampled per prompt (GRPO's group; PPO samples as many). The
    batch of every step is split into ``ppo_mini_batches`` optimiser steps, repeated
    ``ppo_epochs`` times. ``gamma``/``lam``/``value_clip`` are used by PPO only.
    """

    name: str = "grpo"
    group_size: int = 8
    clip_ratio: float = 0.2
    ppo_epochs: int = 1
    ppo_mini_batches: int = 2
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.5

    def __post_init__(self) -> None:
        if self.name not in ALGORITHMS:
            raise ConfigError(
                f"algorithm.name must be one of {', '.join(ALGORITHMS)}, got {self.name!r}"
            )
        _positive("algorithm", group_size=self.group_size, clip_ratio=self.clip_ratio,
                  ppo_epochs=self.ppo_epochs, ppo_mini_batches=self.ppo_mini_batches,
                  value_clip=self.value_clip)
        if self.name == "grpo" and self.group_size < 2:
            raise ConfigError(
                "algorithm.group_size must be >= 2 for GRPO (advantages are relative to the "
                f"group), got {self.group_size}"
            )
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(
                    f"algorithm.{name} must be in [0, 1], got {getattr(self, name)!r}"
                )


@dataclass
class OptimConfig:
    """AdamW settings of one training worker group."""

    lr: float = 1e-2
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        _positive("optim", lr=self.lr, max_grad_norm=self.max_grad_norm)
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay must be >= 0, got {self.weight_decay!r}")


@dataclass
class ActorConfig:
    """The ``actor_wg``: ``world_size`` ranks, the model sharded across them with FSDP2."""

    world_size: int = 2
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        _positive("actor", world_size=self.world_size)


@dataclass
class CriticConfig:
    """The critic (value model) worker group; created only for ``algorithm.name=ppo``."""

    world_size: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        _positive("critic", world_size=self.world_size)


@dataclass
class RolloutConfig:
    """The rollout replicas and how weights reach them.

    Attributes:
        name: rollout server implementation, looked up in
            :data:`weightsync_trainer.llm_server.ROLLOUT_REPLICA_CLASSES` (``hf``, ``vllm``).
        num_replicas: inference server instances (disaggregated mode; in colocated mode
            every actor rank serves one replica).
        workers_per_replica: rollout worker processes per replica, each with a full model
            copy; a replica splits each request's prompts across them.
        tensor_parallel_size: rollout workers per replica that split its model as vLLM's
            tensor parallelism does (``llama``/``qwen2`` models; ``workers_per_replica`` must
            then be 1): each receives only its slices from a sharded backend
            (``gloo_sharded``, ``nixl_sharded``, ``mooncake_sharded``) and keeps its slices
            of whole tensors from the others; the replica's first worker generates, with
            the others' slices assembled.
        temperature: sampling temperature.
        checkpoint_manager_class: fully-qualified name of a ``CheckpointEngineManager``
            subclass built instead of the default (``None``: the default).
        checkpoint_engine: the weight-sync configuration of weightsync-core.
    """

    name: str = "hf"
    num_replicas: int = 2
    workers_per_replica: int = 1
    tensor_parallel_size: int = 1
    temperature: float = 1.0
    checkpoint_manager_class: str | None = None
    checkpoint_engine: CheckpointEngineConfig = field(
        default_factory=lambda: CheckpointEngineConfig(
            backend="gloo", update_weights_bucket_megabytes=16, sync_timeout_seconds=120.0
        )
    )

    def __post_init__(self) -> None:
        _positive("rollout", num_replicas=self.num_replicas,
                  workers_per_replica=self.workers_per_replica,
                  tensor_parallel_size=self.tensor_parallel_size, temperature=self.temperature)
        if self.tensor_parallel_size > 1 and self.workers_per_replica != 1:
            raise ConfigError(
                f"rollout.tensor_parallel_size={self.tensor_parallel_size} with "
                f"rollout.workers_per_replica={self.workers_per_replica}: a tensor-parallel "
                "replica's workers split one model; set workers_per_replica=1")


@dataclass
class TrainerConfig:
    """The training loop.

    Attributes:
        total_steps: training steps (each: generate, reward, update, sync).
        prompts_per_step: prompts per step; each is sampled ``algorithm.group_size`` times.
        seed: seeds prompts and sampling.
        output_dir: where the CLI writes metrics, the plot and the weights
            (``None``: ``outputs/<timestamp>``).
        torch_threads: intra-op threads per worker process (keep the total within the cores).
        ray_num_cpus: CPUs of the local Ray instance the CLI starts (``None``: all).
        ray_address: a running Ray cluster for the CLI to connect to (``HOST:PORT``, or
            ``auto``: the one ``ray start`` started on this machine); ``None``: the
            ``RAY_ADDRESS`` environment variable, else a private local instance (beside any
            cluster running on the machine).
    """

    total_steps: int = 30
    prompts_per_step: int = 8
    seed: int = 0
    output_dir: str | None = None
    torch_threads: int = 1
    ray_num_cpus: int | None = None
    ray_address: str | None = None

    def __post_init__(self) -> None:
        _positive("trainer", total_steps=self.total_steps,
                  prompts_per_step=self.prompts_per_step, torch_threads=self.torch_threads)
        if self.ray_num_cpus is not None:
            _positive("trainer", ray_num_cpus=self.ray_num_cpus)


@dataclass
class ExperimentConfig:
    """Everything one run needs; cross-section constraints are checked here."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        if self.task.target_token >= self.model.vocab_size:
            raise ConfigError(
                f"task.target_token ({self.task.target_token}) must be < model.vocab_size "
                f"({self.model.vocab_size})"
            )
        length = self.task.prompt_length + self.task.response_length
        if length > self.model.max_position_embeddings:
            raise ConfigError(
                f"task.prompt_length + task.response_length ({length}) exceeds "
                f"model.max_position_embeddings ({self.model.max_position_embeddings})"
            )
        sequences = self.sequences_per_step
        groups = [("actor", self.actor.world_size)]
        if self.uses_critic:
            groups.append(("critic", self.critic.world_size))
        for role, world_size in groups:
            if sequences % (world_size * self.algorithm.ppo_mini_batches):
                raise ConfigError(
                    f"each step samples trainer.prompts_per_step * algorithm.group_size = "
                    f"{sequences} sequences, which must split evenly into {role}.world_size "
                    f"({world_size}) * algorithm.ppo_mini_batches "
                    f"({self.algorithm.ppo_mini_batches}) parts; change one of them"
                )

    @property
    def uses_critic(self) -> bool:
        """Whether the algorithm needs a critic worker group."""
        return self.algorithm.name == "ppo"

    @property
    def sequences_per_step(self) -> int:
        """Responses sampled per step."""
        return self.trainer.prompts_per_step * self.algorithm.group_size


@dataclass
class TrainingWorkerConfig:
    """What one training worker process (actor or critic rank) is built from.

    It crosses the Ray actor boundary (pickled), so everything in it must be serialisable.

    Attributes:
        model_type: ``"causal_lm"`` (actor) or ``"value_model"`` (critic).
        model: the model definition.
        optim: optimiser settings.
        algorithm: loss settings.
        world_size: ranks in this worker group (FSDP2 shards across them).
        checkpoint_engine: weight-sync configuration; every worker imports its
            ``custom_backend_module`` before the backend is resolved.
        temperature: the rollout's sampling temperature (log-probabilities use it; a
            colocated actor also samples with it).
        torch_threads: intra-op threads of the worker process.
        extra_context: free-form values for custom workers (any picklable value, tensors
            included), injected per role by a :class:`~weightsync_trainer.TaskRunner` subclass.
    """

    model_type: str
    model: ModelConfig
    optim: OptimConfig
    algorithm: AlgorithmConfig
    world_size: int
    checkpoint_engine: CheckpointEngineConfig
    temperature: float = 1.0
    torch_threads: int = 1
    extra_context: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_type not in ("causal_lm", "value_model"):
            raise ConfigError(
                "TrainingWorkerConfig.model_type must be 'causal_lm' or 'value_model', got "
                f"{self.model_type!r}"
            )
        if not isinstance(self.extra_context, dict):
            raise ConfigError(
                "TrainingWorkerConfig.extra_context must be a dict, got "
                f"{type(self.extra_context).__name__}"
            )
