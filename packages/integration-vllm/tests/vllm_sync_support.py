"""What the vLLM tests share: the sync configuration, and a sender with a Hugging Face copy
of its weights that tells the greedy tokens vLLM must give after a sync."""

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import ray
import torch
import transformers
from vllm_test_actors import FaultySource

from weightsync_core import (
    CheckpointEngineConfig,
    CheckpointEngineManager,
    RayRolloutReplica,
    RayWorkerGroup,
)
from weightsync_core.testing.weights import Faults
from weightsync_vllm.model_source import perturb_

SEEDS = itertools.count(1)


def sync_config(backend: str, timeout: float = 60) -> CheckpointEngineConfig:
    """1 MiB buckets: a model's 2 MiB embedding and head are chunked across buckets."""
    return CheckpointEngineConfig(backend=backend, update_weights_bucket_megabytes=1,
                                  sync_timeout_seconds=timeout)


@contextlib.contextmanager
def running_rollout(worker_class: type, model_path: str, engine_args: dict[str, Any] | None = None,
                    env: dict[str, str] | None = None) -> Iterator[Any]:
    """A greedy vLLM rollout worker of ``worker_class`` serving ``model_path`` (1 GiB of KV
    cache; ``engine_args`` and ``env`` added), started (``start()`` where the class has one)
    and shut down after."""
    worker = ray.remote(num_cpus=0)(worker_class).remote(
        sync_config("gloo"), model_path, engine_args, temperature=0.0,
        env={"VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
    )
    ray.get(worker.start.remote() if hasattr(worker_class, "start")
            else worker.__ray_ready__.remote())
    try:
        yield worker
    finally:
        ray.get(worker.shutdown.remote())
        ray.kill(worker)


class Sender:
    """A sending actor (a :class:`FaultySource`, well-behaved until told otherwise) and a
    Hugging Face model holding the same weights, in this process."""

    def __init__(self, model_path: str, backend: str = "gloo") -> None:
        self.model_path, self.backend = model_path, backend
        self.perturbations: list[tuple[int, float]] = []
        self.actor = self._started()
        self.reference = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32)

    def perturb(self, prompts: torch.Tensor, new_tokens: int,
                fraction: float = 1.0) -> torch.Tensor:
        """New weights on both sides (a fresh seed; only about ``fraction`` of each tensor's
        elements change); returns the reference's greedy tokens after ``prompts``."""
        seed = next(SEEDS)
        ray.get(self.actor.perturb.remote(seed, fraction=fraction))
        self.perturbations.append((seed, fraction))
        perturb_(self.reference, seed, fraction=fraction)
        output = self.reference.generate(prompts, attention_mask=torch.ones_like(prompts),
                                         do_sample=False, max_new_tokens=new_tokens,
                                         pad_token_id=0)
        return output[:, prompts.shape[1]:]

    def sync_into(self, rollout, backend: str = "gloo", faults: Faults | None = None,
                  step: int | None = None, replica: Any = None,
                  ) -> tuple[CheckpointEngineManager, dict[str, float]]:
        """One sync over ``backend`` (both engines switched to it) into the rollout actor
        ``rollout`` (a one-worker replica unless ``replica`` is given), the sender
        misbehaving as ``faults`` says; returns the manager and the sync's metrics."""
        manager = self.manager_into(rollout, backend, faults, replica)
        return manager, manager.update_weights(next(SEEDS) if step is None else step)

    def manager_into(self, rollout, backend: str = "gloo", faults: Faults | None = None,
                     replica: Any = None, **config: Any) -> CheckpointEngineManager:
        """A manager of syncs over ``backend`` (both engines switched to it, the config's
        fields ``config`` changed) into ``rollout`` (or ``replica``)."""
        chosen = dataclasses.replace(sync_config(backend), **config)
        ray.get([self.actor.init_checkpoint_engine.remote(chosen),
                 self.actor.set_faults.remote(faults or Faults()),
                 rollout.set_checkpoint_engine.remote(chosen)])
        return CheckpointEngineManager(chosen, RayWorkerGroup([self.actor]),
                                       [replica or RayRolloutReplica([rollout])])

    def restart(self) -> None:
        """A new sending actor in place of this one (killed, or dead), holding the same
        weights (every perturbation replayed)."""
        ray.kill(self.actor)
        self.actor = self._started()

    def _started(self) -> Any:
        actor = ray.remote(num_cpus=0)(FaultySource).remote(sync_config(self.backend),
                                                            self.model_path, Faults())
        for seed, fraction in self.perturbations:  # in turn: float sums depend on order
            ray.get(actor.perturb.remote(seed, fraction=fraction))
        return actor

    def kill(self) -> None:
        ray.kill(self.actor)
