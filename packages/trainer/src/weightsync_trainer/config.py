"""Configuration dataclasses of an experiment, validated on construction.

The tree follows verl's (``verl/trainer/config/ppo_trainer.yaml``): every setting verl has is
at verl's key path (``actor_rollout_ref.rollout.checkpoint_engine.backend``,
``trainer.total_training_steps``, ``algorithm.adv_estimator``, ...); the settings verl has not
(the random model's size, the synthetic task, the replicas, the Ray address) sit beside them.
The defaults live in ``conf/ppo_trainer.yaml`` next to this module;
:mod:`weightsync_trainer.config_loader` composes it with a user's YAML file and Hydra
overrides and builds these classes.

A check that concerns one section names its keys relative to that section
(``lr must be > 0``); the loader prefixes the section's path
(``actor_rollout_ref.actor.optim.lr must be > 0``). Checks across sections name full paths.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from weightsync_core import CheckpointEngineConfig
from weightsync_trainer.errors import ConfigError

__all__ = [
    "ADV_ESTIMATORS",
    "MOE_MODEL_TYPES",
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DataConfig",
    "ExperimentConfig",
    "ModelConfig",
    "OptimConfig",
    "RayInitConfig",
    "RayKwargsConfig",
    "RolloutConfig",
    "TaskConfig",
    "TrainerConfig",
    "TrainingWorkerConfig",
]

ADV_ESTIMATORS = ("gae", "grpo")
"""``algorithm.adv_estimator`` values: ``grpo`` (group-relative advantages, no critic) and
``gae`` (PPO: a critic and generalised advantage estimation), as verl names them."""


def _positive(**values: float | None) -> None:
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value!r}")


MOE_MODEL_TYPES = frozenset({"qwen3_moe"})
"""Model types built as mixtures of experts from :class:`ModelConfig`'s ``num_experts``,
``num_experts_per_tok`` and ``moe_intermediate_size``."""


@dataclass
class ModelConfig:
    """``actor_rollout_ref.model``: the Hugging Face causal LM trained by the actor and served
    by the rollout.

    With ``path`` unset the model is built from ``model_type`` and the size fields (random
    initialisation from ``seed``, no download); with ``path`` set it is loaded with
    ``from_pretrained(path)`` and the size fields are ignored. ``path`` is verl's key; the
    others are this trainer's, but for the LoRA keys (verl's): ``lora_rank`` > 0 trains a
    PEFT LoRA adapter of that rank, ``lora_alpha``, on ``target_modules`` (a list of module
    names), the base model frozen; the base syncs once, then each step syncs the adapter
    only (``CheckpointEngineManager.update_adapter``).
    """

    path: str | None = None
    model_type: str = "llama"
    vocab_size: int = 16
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    seed: int = 0
    num_experts: int = 0
    """Routed experts per layer of a mixture of experts (``model_type: qwen3_moe``); 0: a
    dense model."""
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])

    def __post_init__(self) -> None:
        _positive(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
        )
        if (self.num_experts > 0) != (self.model_type in MOE_MODEL_TYPES) or \
                self.num_experts < 0:
            raise ConfigError(
                f"num_experts={self.num_experts} with model_type={self.model_type!r}: a "
                f"mixture of experts ({', '.join(sorted(MOE_MODEL_TYPES))}) needs num_experts "
                "> 0, any other model_type num_experts 0")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) cannot exceed "
                              f"num_experts ({self.num_experts})")
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be >= 0 (0: train every weight), got "
                              f"{self.lora_rank}")
        if self.lora_rank and (isinstance(self.target_modules, str) or not self.target_modules):
            raise ConfigError(
                f"target_modules must be a non-empty list of module names (q_proj, v_proj, "
                f"...) with lora_rank > 0, got {self.target_modules!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


@dataclass
class OptimConfig:
    """``actor_rollout_ref.actor.optim`` and ``critic.optim``: AdamW of one training worker
    group, with gradients clipped to norm ``clip_grad`` (verl's keys)."""

    lr: float = 1e-2
    weight_decay: float = 0.0
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        _positive(lr=self.lr, clip_grad=self.clip_grad)
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay!r}")

    @property
    def max_grad_norm(self) -> float:
        """Deprecated name of :attr:`clip_grad` (until 0.8)."""
        return self.clip_grad


def _mini_batch_checks(ppo_epochs: int, ppo_mini_batch_size: int) -> None:
    _positive(ppo_epochs=ppo_epochs, ppo_mini_batch_size=ppo_mini_batch_size)


@dataclass
class ActorConfig:
    """``actor_rollout_ref.actor``: the policy update of ``actor_wg``.

    Attributes:
        optim: the optimiser.
        clip_ratio: the clipped surrogate's epsilon.
        ppo_epochs: passes over each step's batch.
        ppo_mini_batch_size: prompts per optimiser step (verl's unit: each brings its
            ``actor_rollout_ref.rollout.n`` responses); ``data.train_batch_size`` must be a
            multiple of it.
    """

    optim: OptimConfig = field(default_factory=OptimConfig)
    clip_ratio: float = 0.2
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 4

    def __post_init__(self) -> None:
        _positive(clip_ratio=self.clip_ratio)
        _mini_batch_checks(self.ppo_epochs, self.ppo_mini_batch_size)


@dataclass
class RolloutConfig:
    """``actor_rollout_ref.rollout``: the rollout replicas and how weights reach them.

    Attributes:
        name: rollout server implementation, looked up in
            :data:`weightsync_trainer.llm_server.ROLLOUT_REPLICA_CLASSES` (``hf``, ``vllm``).
        n: responses sampled per prompt (GRPO's group).
        temperature: sampling temperature.
        tensor_model_parallel_size: rollout workers per replica that split its model as vLLM's
            tensor parallelism does (``llama``/``qwen2`` models; ``workers_per_replica`` must
            then be 1): each receives only its slices from a sharded backend
            (``gloo_sharded``, ``nixl_sharded``, ``mooncake_sharded``) and keeps its slices
            of whole tensors from the others; the replica's first worker generates, with
            the others' slices assembled.
        num_replicas: inference server instances (disaggregated mode; in colocated mode
            every actor rank serves one replica). Not a verl key.
        workers_per_replica: rollout worker processes per replica, each with a full model
            copy; a replica splits each request's prompts across them. Not a verl key.
        checkpoint_manager_class: fully-qualified name of a ``CheckpointEngineManager``
            subclass built instead of the default (``None``: the default); verl reads the
            same key.
        checkpoint_engine: the weight-sync configuration of weightsync-core.
    """

    name: str = "hf"
    n: int = 8
    temperature: float = 1.0
    tensor_model_parallel_size: int = 1
    num_replicas: int = 2
    workers_per_replica: int = 1
    checkpoint_manager_class: str | None = None
    checkpoint_engine: CheckpointEngineConfig = field(
        default_factory=lambda: CheckpointEngineConfig(
            backend="gloo", update_weights_bucket_megabytes=16, sync_timeout_seconds=120.0
        )
    )

    def __post_init__(self) -> None:
        _positive(n=self.n, temperature=self.temperature,
                  tensor_model_parallel_size=self.tensor_model_parallel_size,
                  num_replicas=self.num_replicas, workers_per_replica=self.workers_per_replica)
        if self.tensor_model_parallel_size > 1 and self.workers_per_replica != 1:
            raise ConfigError(
                f"tensor_model_parallel_size={self.tensor_model_parallel_size} with "
                f"workers_per_replica={self.workers_per_replica}: a tensor-parallel "
                "replica's workers split one model; set workers_per_replica=1")


@dataclass
class ActorRolloutRefConfig:
    """``actor_rollout_ref``: the model, its training (``actor``) and its serving
    (``rollout``), as verl groups them."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticConfig:
    """``critic``: the value model's worker group; created only for
    ``algorithm.adv_estimator=gae``.

    Attributes:
        world_size: its FSDP2 ranks (verl's critic shares the actor's GPUs; this trainer
            gives it its own ranks). Not a verl key.
        optim: the optimiser.
        ppo_epochs, ppo_mini_batch_size: as the actor's (the packaged defaults interpolate
            them from ``actor_rollout_ref.actor``, as verl's do).
        cliprange_value: the clipped value loss's range.
    """

    world_size: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 4
    cliprange_value: float = 0.5

    def __post_init__(self) -> None:
        _positive(world_size=self.world_size, cliprange_value=self.cliprange_value)
        _mini_batch_checks(self.ppo_epochs, self.ppo_mini_batch_size)


@dataclass
class DataConfig:
    """``data``: the prompts of each step.

    Attributes:
        train_batch_size: prompts per step; each is sampled ``actor_rollout_ref.rollout.n``
            times.
        max_prompt_length: tokens per prompt (the synthetic task's prompts all have this
            length).
        max_response_length: tokens per response (responses always have this length: the
            model has no EOS).
    """

    train_batch_size: int = 8
    max_prompt_length: int = 4
    max_response_length: int = 8

    def __post_init__(self) -> None:
        _positive(train_batch_size=self.train_batch_size,
                  max_prompt_length=self.max_prompt_length,
                  max_response_length=self.max_response_length)


@dataclass
class TaskConfig:
    """``task``: the synthetic task, reward = fraction of response tokens equal to
    ``target_token``. Not a verl section."""

    target_token: int = 3

    def __post_init__(self) -> None:
        if self.target_token < 0:
            raise ConfigError(f"target_token must be >= 0, got {self.target_token}")


@dataclass
class AlgorithmConfig:
    """``algorithm``: the advantage estimator and GAE's discounting.

    Attributes:
        adv_estimator: ``grpo`` (advantages relative to each prompt's group) or ``gae`` (PPO:
            a critic, generalised advantage estimation).
        gamma, lam: GAE's discount and lambda (``gae`` only).
    """

    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 0.95

    def __post_init__(self) -> None:
        if self.adv_estimator not in ADV_ESTIMATORS:
            hint = " (PPO with a critic is gae, as in verl)" if self.adv_estimator == "ppo" else ""
            raise ConfigError(
                f"adv_estimator must be one of {', '.join(ADV_ESTIMATORS)}, got "
                f"{self.adv_estimator!r}{hint}"
            )
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")

    @property
    def name(self) -> str:
        """Deprecated (until 0.8): ``"ppo"`` for ``gae``, else :attr:`adv_estimator`."""
        return "ppo" if self.adv_estimator == "gae" else self.adv_estimator


@dataclass
class AsyncRolloutConfig:
    """``trainer.async_rollout``: asynchronous RL, rollout of the next steps overlapping the
    actor's update of this one.

    Attributes:
        enable: while the actor trains on step N's batch and its weights are staged into
            the replicas, the replicas already generate step N+1's batch with the version
            they serve (off by default: synchronous, every batch from the newest weights).
        max_staleness: how many actor updates a batch's oldest token may lag behind the
            actor that trains on it (0: as synchronous, each batch waits for the sync before
            it is generated; 1: generated while the previous batch trains).
        is_threshold: with ``enable``, each token's loss is weighted by the ratio of the
            actor's probability before this update to the probability of the weights that
            sampled it (decoupled PPO, as AReaL and PipelineRL do: the clip is against the
            actor before the update, and the ratio corrects for the older sampler),
            truncated at this value.
    """

    enable: bool = False
    max_staleness: int = 1
    is_threshold: float = 2.0

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ConfigError("trainer.async_rollout.max_staleness must be >= 0, got "
                              f"{self.max_staleness!r}")
        if not self.is_threshold >= 1.0:
            raise ConfigError("trainer.async_rollout.is_threshold must be >= 1.0 (a "
                              f"truncation of importance weights), got {self.is_threshold!r}")


@dataclass
class TrainerConfig:
    """``trainer``: the training loop.

    Attributes:
        total_training_steps: training steps (each: generate, reward, update, sync).
        nnodes, n_gpus_per_node: the actor's ranks are ``nnodes * n_gpus_per_node`` (verl's
            keys; here each rank is a CPU process).
        seed: seeds prompts and sampling.
        output_dir: where the CLI writes metrics, the plot and the weights
            (``None``: ``outputs/<timestamp>``).
        torch_threads: intra-op threads per worker process (keep the total within the cores).
        ray_address: a running Ray cluster for the CLI to connect to (``HOST:PORT``, or
            ``auto``: the one ``ray start`` started on this machine); ``None``: the
            ``RAY_ADDRESS`` environment variable, else a private local instance (beside any
            cluster running on the machine).
        async_rollout: asynchronous RL (:class:`AsyncRolloutConfig`).
    """

    total_training_steps: int = 30
    nnodes: int = 1
    n_gpus_per_node: int = 2
    seed: int = 0
    output_dir: str | None = None
    torch_threads: int = 1
    ray_address: str | None = None
    async_rollout: AsyncRolloutConfig = field(default_factory=AsyncRolloutConfig)

    def __post_init__(self) -> None:
        _positive(total_training_steps=self.total_training_steps, nnodes=self.nnodes,
                  n_gpus_per_node=self.n_gpus_per_node, torch_threads=self.torch_threads)


@dataclass
class RayInitConfig:
    """``ray_kwargs.ray_init``: the local Ray instance the CLI starts.

    Attributes:
        num_cpus: its CPUs (``None``: all of the machine's).
    """

    num_cpus: int | None = None

    def __post_init__(self) -> None:
        _positive(num_cpus=self.num_cpus)


@dataclass
class RayKwargsConfig:
    """``ray_kwargs``: how the CLI starts Ray."""

    ray_init: RayInitConfig = field(default_factory=RayInitConfig)


@dataclass
class ExperimentConfig:
    """Everything one run needs; cross-section constraints are checked here."""

    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)

    def __post_init__(self) -> None:
        model = self.actor_rollout_ref.model
        if self.task.target_token >= model.vocab_size:
            raise ConfigError(
                f"task.target_token ({self.task.target_token}) must be < "
                f"actor_rollout_ref.model.vocab_size ({model.vocab_size})"
            )
        length = self.data.max_prompt_length + self.data.max_response_length
        if length > model.max_position_embeddings:
            raise ConfigError(
                f"data.max_prompt_length + data.max_response_length ({length}) exceeds "
                f"actor_rollout_ref.model.max_position_embeddings "
                f"({model.max_position_embeddings})"
            )
        if self.algorithm.adv_estimator == "grpo" and self.actor_rollout_ref.rollout.n < 2:
            raise ConfigError(
                "actor_rollout_ref.rollout.n must be >= 2 for algorithm.adv_estimator=grpo "
                f"(advantages are relative to the group), got {self.actor_rollout_ref.rollout.n}"
            )
        groups = [("actor_rollout_ref.actor", self.actor_rollout_ref.actor.ppo_mini_batch_size,
                   "trainer.nnodes * trainer.n_gpus_per_node", self.actor_world_size)]
        if self.uses_critic:
            groups.append(("critic", self.critic.ppo_mini_batch_size, "critic.world_size",
                           self.critic.world_size))
        for section, mini_batch, ranks, world_size in groups:
            self._check_mini_batches(section, mini_batch, ranks, world_size)
        engine = self.actor_rollout_ref.rollout.checkpoint_engine
        if self.trainer.async_rollout.enable and engine.backend == "naive":
            raise ConfigError(
                "trainer.async_rollout.enable=true needs rollout replicas of their own: with "
                "the colocated backend 'naive' the actor's processes generate, and cannot "
                "while they train; choose another actor_rollout_ref.rollout.checkpoint_engine."
                "backend (gloo, nixl, ...)")

    def _check_mini_batches(self, section: str, mini_batch: int, ranks: str,
                            world_size: int) -> None:
        prompts = self.data.train_batch_size
        if prompts % mini_batch:
            raise ConfigError(
                f"data.train_batch_size ({prompts}) must be a multiple of "
                f"{section}.ppo_mini_batch_size ({mini_batch}): each step's prompts are "
                "split into mini-batches of that many prompts; change one of them"
            )
        sequences = mini_batch * self.actor_rollout_ref.rollout.n
        if sequences % world_size:
            raise ConfigError(
                f"each mini-batch holds {section}.ppo_mini_batch_size * "
                f"actor_rollout_ref.rollout.n = {sequences} sequences, which must split "
                f"evenly over the {world_size} ranks of {ranks}; change one of them"
            )

    @property
    def uses_critic(self) -> bool:
        """Whether the algorithm needs a critic worker group (``adv_estimator=gae``)."""
        return self.algorithm.adv_estimator == "gae"

    @property
    def actor_world_size(self) -> int:
        """Ranks of ``actor_wg``: ``trainer.nnodes * trainer.n_gpus_per_node``."""
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def sequences_per_step(self) -> int:
        """Responses sampled per step."""
        return self.data.train_batch_size * self.actor_rollout_ref.rollout.n

    def ppo_mini_batches(self, role: str) -> int:
        """Optimiser steps per epoch of ``role`` (``actor`` or ``critic``)."""
        section = self.actor_rollout_ref.actor if role == "actor" else self.critic
        return self.data.train_batch_size // section.ppo_mini_batch_size

    @property
    def model(self) -> ModelConfig:
        """Deprecated (until 0.8): :attr:`actor_rollout_ref.model
        <ActorRolloutRefConfig.model>`."""
        _moved("ExperimentConfig.model", "actor_rollout_ref.model")
        return self.actor_rollout_ref.model

    @property
    def rollout(self) -> RolloutConfig:
        """Deprecated (until 0.8): :attr:`actor_rollout_ref.rollout
        <ActorRolloutRefConfig.rollout>`."""
        _moved("ExperimentConfig.rollout", "actor_rollout_ref.rollout")
        return self.actor_rollout_ref.rollout


def _moved(old: str, new: str) -> None:
    warnings.warn(f"{old} is now ExperimentConfig.{new} (verl's key path); the old name "
                  "works until weightsync-trainer 0.8", DeprecationWarning, stacklevel=3)


@dataclass
class TrainingWorkerConfig:
    """What one training worker process (actor or critic rank) is built from.

    It crosses the Ray actor boundary (pickled), so everything in it must be serialisable.

    Attributes:
        model_type: ``"causal_lm"`` (actor) or ``"value_model"`` (critic).
        model: the model definition.
        optim: optimiser settings.
        world_size: ranks in this worker group (FSDP2 shards across them).
        checkpoint_engine: weight-sync configuration; every worker imports its
            ``custom_backend_module`` before the backend is resolved.
        ppo_epochs: passes over each step's batch.
        ppo_mini_batches: optimiser steps per pass (the batch split evenly).
        clip_ratio: the policy loss's clip (actor).
        cliprange_value: the value loss's clip (critic).
        temperature: the rollout's sampling temperature (log-probabilities use it; a
            colocated actor also samples with it).
        torch_threads: intra-op threads of the worker process.
        is_threshold: the truncation of the importance weights of a batch that carries the
            sampling weights' log-probabilities (asynchronous RL; actor).
        extra_context: free-form values for custom workers (any picklable value, tensors
            included), injected per role by a :class:`~weightsync_trainer.TaskRunner` subclass.
    """

    model_type: str
    model: ModelConfig
    optim: OptimConfig
    world_size: int
    checkpoint_engine: CheckpointEngineConfig
    ppo_epochs: int = 1
    ppo_mini_batches: int = 1
    clip_ratio: float = 0.2
    cliprange_value: float = 0.5
    temperature: float = 1.0
    torch_threads: int = 1
    is_threshold: float = 2.0
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
