"""The RL training loop: generate, reward, update actor (and critic), sync weights."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import ray
import torch

from weightsync_core import (
    CheckpointEngineManager,
    CheckpointEngineRegistry,
    load_checkpoint_manager_class,
    load_custom_backend_module,
    run_sync,
)
from weightsync_trainer.algorithms import gae_advantages, grpo_advantages, whiten
from weightsync_trainer.async_rollout import AsyncRollout
from weightsync_trainer.config import ExperimentConfig, TrainingWorkerConfig
from weightsync_trainer.groups import TrainingWorkerGroup
from weightsync_trainer.llm_server import LLMServerClient, LLMServerManager
from weightsync_trainer.lora import ADAPTER_NAME
from weightsync_trainer.task import TargetTokenTask
from weightsync_trainer.workers.actor import ActorWorker
from weightsync_trainer.workers.critic import CriticWorker

__all__ = ["RayPPOTrainer"]

StepCallback = Callable[[dict[str, float]], None]

T = TypeVar("T")


def _mean_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    return {key: sum(m[key] for m in per_rank) / len(per_rank) for key in per_rank[0]}


class RayPPOTrainer:
    """Drives one experiment on Ray (GRPO or PPO, colocated or disaggregated).

    Workers: ``actor_wg`` (:class:`ActorWorker` ranks), the critic group for PPO, and the
    rollout replicas of :attr:`server_manager_cls`. Weights move from ``actor_wg`` to the
    replicas through a :class:`~weightsync_core.CheckpointEngineManager` (or the subclass named
    by ``actor_rollout_ref.rollout.checkpoint_manager_class``) after every step; with a LoRA
    actor (``actor_rollout_ref.model.lora_rank`` > 0) the base once, then only the adapter
    (``update_adapter``), each step's requests naming the adapter version they sample from.

    Per-role context: set ``_actor_extra_context`` / ``_critic_extra_context`` (dicts) on the
    trainer before :meth:`init_workers`; each becomes that role's
    ``TrainingWorkerConfig.extra_context`` (a :class:`~weightsync_trainer.TaskRunner` subclass
    does this).

    The custom backend module and the manager class are loaded here, in the driver, before any
    worker starts, so that a bad name fails fast.
    """

    server_manager_cls: type[LLMServerManager] = LLMServerManager
    client_cls: type[LLMServerClient] = LLMServerClient

    def __init__(self, config: ExperimentConfig) -> None:
        self.config = config
        rollout = config.actor_rollout_ref.rollout
        engine_config = rollout.checkpoint_engine
        load_custom_backend_module(engine_config.custom_backend_module,
                                   engine_config.trusted_modules)
        CheckpointEngineRegistry.get(engine_config.backend)
        self.checkpoint_manager_cls = load_checkpoint_manager_class(
            rollout.checkpoint_manager_class
        )
        self.task = TargetTokenTask(config.task, config.actor_rollout_ref.model, config.data)
        self.actor_options: dict[str, Any] = {"num_cpus": 0}
        self.actor_wg: TrainingWorkerGroup | None = None
        self.critic_wg: TrainingWorkerGroup | None = None
        self.server_manager: LLMServerManager | None = None
        self.client: LLMServerClient | None = None
        self.checkpoint_manager: CheckpointEngineManager | None = None
        self._generator = torch.Generator().manual_seed(config.trainer.seed)
        self.adapter_version: int | None = None
        """The adapter version requests are served on (a LoRA actor; None: the weights)."""

    def worker_config(self, role: str) -> TrainingWorkerConfig:
        """The :class:`TrainingWorkerConfig` of ``role`` (``actor`` or ``critic``)."""
        config = self.config
        actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
        section = actor if role == "actor" else config.critic
        return TrainingWorkerConfig(
            model_type="causal_lm" if role == "actor" else "value_model",
            model=config.actor_rollout_ref.model,
            optim=section.optim,
            world_size=config.actor_world_size if role == "actor" else config.critic.world_size,
            checkpoint_engine=rollout.checkpoint_engine,
            ppo_epochs=section.ppo_epochs,
            ppo_mini_batches=config.ppo_mini_batches(role),
            clip_ratio=actor.clip_ratio,
            cliprange_value=config.critic.cliprange_value,
            temperature=rollout.temperature,
            torch_threads=config.trainer.torch_threads,
            is_threshold=config.trainer.async_rollout.is_threshold,
            extra_context=getattr(self, f"_{role}_extra_context", None) or {},
        )

    async def init_workers(self) -> None:
        """Start every worker group and the rollout replicas, then sync the initial weights
        (``global_steps=0``)."""
        self.actor_wg = TrainingWorkerGroup.spawn(
            ActorWorker, self.worker_config("actor"), self.actor_options
        )
        groups = [self.actor_wg]
        if self.config.uses_critic:
            self.critic_wg = TrainingWorkerGroup.spawn(
                CriticWorker, self.worker_config("critic"), self.actor_options
            )
            groups.append(self.critic_wg)
        # rollout workers start while the training groups initialise
        self.server_manager = self.server_manager_cls(
            self.config, actor_wg=self.actor_wg, actor_options=self.actor_options
        )
        await asyncio.gather(*(group.init_model() for group in groups))
        await self.server_manager.wait_ready()
        self.client = self.server_manager.get_client(self.client_cls)
        self.checkpoint_manager = self.checkpoint_manager_cls(
            config=self.config.actor_rollout_ref.rollout.checkpoint_engine,
            actor_wg=self.actor_wg,
            replicas=self.server_manager.replicas,
        )
        await self.checkpoint_manager.update_weights(global_steps=0)
        if self.config.actor_rollout_ref.model.lora_rank:
            await self.checkpoint_manager.update_adapter(0, ADAPTER_NAME)
            self.adapter_version = 0

    def _adapter(self) -> tuple[str, int] | None:
        """What this step's requests name: the last adapter version synced (None: no
        adapter)."""
        return None if self.adapter_version is None else (ADAPTER_NAME, self.adapter_version)

    async def sync(self, step: int) -> dict[str, float]:
        """Move the actor's step-``step`` policy to the replicas: the weights, or, with a
        LoRA actor, only its adapter (then served from the next request on)."""
        manager = self._started(self.checkpoint_manager, "checkpoint_manager")
        if self.adapter_version is None:
            return await manager.update_weights(global_steps=step)
        metrics = await manager.update_adapter(step, ADAPTER_NAME)
        self.adapter_version = step
        return metrics

    async def generate(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``group_size`` responses for each of this step's prompts; returns
        ``(prompt + response ids, responses)`` ordered group by group."""
        group_size = self.config.actor_rollout_ref.rollout.n
        prompts = self.task.sample_prompts(self.config.data.train_batch_size, self._generator)
        base_seed = (self.config.trainer.seed * 1_000_003 + step) * 10_000
        client = self._started(self.client, "client")
        responses = torch.cat(await asyncio.gather(*(
            client.generate(
                prompt.expand(group_size, -1).contiguous(),
                request_id=f"step{step}-prompt{index}",
                seed=base_seed + index * group_size,
                adapter=self._adapter(),
            )
            for index, prompt in enumerate(prompts)
        )))
        input_ids = torch.cat([prompts.repeat_interleave(group_size, dim=0), responses], dim=1)
        return input_ids, responses

    async def sample_batch(self, step: int) -> dict[str, torch.Tensor]:
        """As :meth:`generate`, with what sampled each response token (asynchronous RL):
        ``{"input_ids", "responses", "behaviour_log_probs", "versions"}`` (``versions``: the
        policy version of each token: the weights', or, with a LoRA actor, that of the
        adapter version its request named, which no sync changes mid-response)."""
        group_size = self.config.actor_rollout_ref.rollout.n
        prompts = self.task.sample_prompts(self.config.data.train_batch_size, self._generator)
        base_seed = (self.config.trainer.seed * 1_000_003 + step) * 10_000
        client = self._started(self.client, "client")
        adapter = self._adapter()
        samples = await asyncio.gather(*(
            client.generate_sample(prompt.expand(group_size, -1).contiguous(),
                                   request_id=f"step{step}-prompt{index}",
                                   seed=base_seed + index * group_size, adapter=adapter)
            for index, prompt in enumerate(prompts)
        ))
        responses = torch.cat([sample["tokens"] for sample in samples])
        versions = torch.cat([sample["versions"] for sample in samples])
        if adapter is not None:
            versions = torch.full_like(versions, adapter[1])
        return {
            "input_ids": torch.cat([prompts.repeat_interleave(group_size, dim=0), responses],
                                   dim=1),
            "responses": responses,
            "behaviour_log_probs": torch.cat([sample["log_probs"] for sample in samples]),
            "versions": versions,
        }

    async def _advantages(
        self, input_ids: torch.Tensor, rewards: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        length = self.config.data.max_response_length
        algorithm = self.config.algorithm
        if not self.config.uses_critic:
            return grpo_advantages(rewards, self.config.actor_rollout_ref.rollout.n, length), {}
        critic_wg = self._started(self.critic_wg, "critic_wg")
        values = torch.cat(await asyncio.gather(
            *critic_wg.call_split("compute_values", input_ids, response_length=length)
        ))
        token_rewards = torch.zeros_like(values)
        token_rewards[:, -1] = rewards
        advantages, returns = gae_advantages(token_rewards, values, algorithm.gamma, algorithm.lam)
        return whiten(advantages), {"input_ids": input_ids, "returns": returns, "values": values}

    async def train_step(self, step: int) -> dict[str, float]:
        """One step; returns its metrics (reward, losses, timings and the sync's metrics)."""
        start = time.perf_counter()
        input_ids, responses = await self.generate(step)
        generated = time.perf_counter()
        metrics = await self.train_on(step, input_ids, responses)
        trained = time.perf_counter()
        metrics.update(await self.sync(step))
        metrics.update({
            "timing/generate_s": generated - start,
            "timing/train_s": trained - generated,
            "timing/step_s": time.perf_counter() - start,
        })
        return metrics

    async def train_on(self, step: int, input_ids: torch.Tensor, responses: torch.Tensor,
                      behaviour_log_probs: torch.Tensor | None = None) -> dict[str, float]:
        """Reward ``responses``, then update the actor (and the critic) on them; returns
        the step's reward and the workers' metrics."""
        actor_wg = self._started(self.actor_wg, "actor_wg")
        rewards = self.task.reward(responses)
        advantages, critic_batch = await self._advantages(input_ids, rewards)
        batch = {"input_ids": input_ids, "advantages": advantages}
        if behaviour_log_probs is not None:
            batch["behaviour_log_probs"] = behaviour_log_probs
        calls = [asyncio.gather(*actor_wg.call_split("update_policy", batch))]
        if critic_batch:
            critic_wg = self._started(self.critic_wg, "critic_wg")
            calls.append(asyncio.gather(*critic_wg.call_split("update_critic", critic_batch)))
        updates = await asyncio.gather(*calls)
        metrics: dict[str, float] = {
            "step": step,
            "reward/mean": rewards.mean().item(),
            "reward/max": rewards.max().item(),
        }
        for per_rank in updates:
            metrics.update(_mean_metrics(per_rank))
        return metrics

    async def fit(self, on_step: StepCallback | None = None) -> list[dict[str, float]]:
        """Run ``trainer.total_training_steps`` steps (workers must be initialised);
        ``on_step`` gets each step's metrics as soon as it finishes. With
        ``trainer.async_rollout.enable``, rollout runs ahead of training
        (:class:`~weightsync_trainer.async_rollout.AsyncRollout`)."""
        if self.config.trainer.async_rollout.enable:
            return await AsyncRollout(self).fit(on_step)
        history = []
        for step in range(1, self.config.trainer.total_training_steps + 1):
            metrics = await self.train_step(step)
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
        return history

    def run(self, on_step: StepCallback | None = None) -> list[dict[str, float]]:
        """:meth:`init_workers` (if not done) and :meth:`fit`, from synchronous code."""

        async def main() -> list[dict[str, float]]:
            if self.actor_wg is None:
                await self.init_workers()
            return await self.fit(on_step)

        return run_sync(main())

    def save_weights(self, directory: str) -> str:
        """Save the actor's final weights (safetensors + config.json) into ``directory``."""
        actor_wg = self._started(self.actor_wg, "actor_wg")
        paths = ray.get(actor_wg.call_all("save_weights", directory))
        return paths[0]

    def weights_checksums(self) -> dict[str, Any]:
        """Digest of the actor's weights and of the weights each rollout worker serves."""
        actor_wg = self._started(self.actor_wg, "actor_wg")
        server_manager = self._started(self.server_manager, "server_manager")
        actor = ray.get(actor_wg.call_all("weights_checksum"))[0]
        if server_manager.colocated:
            rollout = ray.get(actor_wg.call_all("rollout_weights_checksum"))
        else:
            rollout = ray.get([worker.weights_checksum.remote()
                               for replica in server_manager.replicas
                               for worker in replica.workers])
        return {"actor": actor, "rollout": rollout}

    def _started(self, value: T | None, name: str) -> T:
        """``value`` (the trainer's attribute ``name``), which :meth:`init_workers` sets."""
        if value is None:
            raise RuntimeError(
                f"{type(self).__name__}.{name} is not set: call init_workers() first"
            )
        return value

    def shutdown(self) -> None:
        """Stop every worker this trainer started."""
        if self.server_manager is not None:
            self.server_manager.shutdown()
        for group in (self.actor_wg, self.critic_wg):
            if group is not None:
                group.kill()
