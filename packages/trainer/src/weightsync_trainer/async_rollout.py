"""Asynchronous RL: the rollout replicas generate the next steps' batches while the actor
trains on this one and its new weights are staged into them (``trainer.async_rollout``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from weightsync_trainer.config import ExperimentConfig

__all__ = ["AsyncRollout", "SteppedTrainer"]


class SteppedTrainer(Protocol):
    """What :class:`AsyncRollout` drives (a :class:`~weightsync_trainer.RayPPOTrainer`)."""

    config: ExperimentConfig
    checkpoint_manager: Any

    async def sample_batch(self, step: int) -> dict[str, torch.Tensor]:
        """Step ``step``'s batch, with each token's log-probability and version."""
        ...

    async def train_on(self, step: int, input_ids: torch.Tensor, responses: torch.Tensor,
                       behaviour_log_probs: torch.Tensor | None = None) -> dict[str, float]:
        """Update the actor on a batch; its metrics."""
        ...

    async def sync(self, step: int) -> dict[str, float]:
        """Move the actor's step-``step`` policy to the replicas; the sync's metrics."""
        ...


class AsyncRollout:
    """Runs a trainer's steps with rollout ahead of training.

    A producer samples step ``j``'s batch as soon as the replicas serve version
    ``j - 1 - max_staleness`` or newer (step ``j`` trains the actor from version ``j - 1``
    to ``j``), so no token of a batch is more than ``max_staleness`` updates older than
    the actor that trains on it; ``max_staleness=0`` is the synchronous schedule. The
    consumer trains on each batch in turn with decoupled PPO's importance weights (each
    token's log-probability as sampled travels with it), then syncs the new version
    (``trainer.sync``): ``update_weights``, which stages it while the replicas keep
    generating and switches them in one short pause, or, with a LoRA actor,
    ``update_adapter``, which adds the adapter's new version beside the ones served and
    pauses nothing (each request names the newest version when it starts).

    Metrics per step, beside the synchronous ones: ``async/staleness_mean`` and
    ``async/staleness_max`` (over the batch's tokens: the actor's version before this step
    less the version that sampled the token), ``async/staleness_<k>`` (responses whose
    oldest token is ``k`` updates old), ``async/spanning_fraction`` (responses sampled with
    two versions: a switch came mid-response) and ``timing/wait_s`` (how long the step
    waited for its batch).
    """

    def __init__(self, trainer: SteppedTrainer) -> None:
        self.trainer = trainer
        self.settings = trainer.config.trainer.async_rollout
        self.served = 0
        """The version every replica serves (the last committed sync's)."""
        self._version_changed = asyncio.Condition()
        self._batches: asyncio.Queue[tuple[dict[str, torch.Tensor], float]] = asyncio.Queue()

    async def _produce(self, steps: int) -> None:
        for step in range(1, steps + 1):
            oldest = step - 1 - self.settings.max_staleness
            async with self._version_changed:
                await self._version_changed.wait_for(lambda oldest=oldest: self.served >= oldest)
            start = time.perf_counter()
            batch = await self.trainer.sample_batch(step)
            await self._batches.put((batch, time.perf_counter() - start))

    async def _next_batch(self, producer: asyncio.Future[None]
                          ) -> tuple[dict[str, torch.Tensor], float]:
        """The next batch, or the producer's error where it failed."""
        getting = asyncio.ensure_future(self._batches.get())
        await asyncio.wait({getting, producer}, return_when=asyncio.FIRST_COMPLETED)
        if not getting.done():
            getting.cancel()
            producer.result()  # raises its error
            raise RuntimeError("the rollout producer stopped before the last step's batch")
        return getting.result()

    async def fit(self, on_step: Callable[[dict[str, float]], None] | None = None
                  ) -> list[dict[str, float]]:
        """Run ``trainer.total_training_steps`` steps; as
        :meth:`~weightsync_trainer.RayPPOTrainer.fit`."""
        trainer = self.trainer
        manager = trainer.checkpoint_manager
        if manager is None:
            raise RuntimeError("AsyncRollout.fit: call the trainer's init_workers() first")
        steps = trainer.config.trainer.total_training_steps
        producer = asyncio.ensure_future(self._produce(steps))
        history: list[dict[str, float]] = []
        try:
            for step in range(1, steps + 1):
                start = time.perf_counter()
                batch, generate_seconds = await self._next_batch(producer)
                waited = time.perf_counter()
                metrics = await trainer.train_on(step, batch["input_ids"], batch["responses"],
                                                batch["behaviour_log_probs"])
                trained = time.perf_counter()
                metrics.update(await trainer.sync(step))
                async with self._version_changed:
                    self.served = step
                    self._version_changed.notify_all()
                metrics.update(self._staleness(step, batch["versions"]))
                metrics.update({
                    "timing/generate_s": generate_seconds,
                    "timing/wait_s": waited - start,
                    "timing/train_s": trained - waited,
                    "timing/step_s": time.perf_counter() - start,
                })
                history.append(metrics)
                if on_step is not None:
                    on_step(metrics)
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
        return history

    def _staleness(self, step: int, versions: torch.Tensor) -> dict[str, float]:
        """The batch's staleness metrics (see the class)."""
        lag = (step - 1 - versions).float()
        oldest = lag.max(dim=1).values
        metrics = {"async/staleness_mean": lag.mean().item(),
                   "async/staleness_max": lag.max().item(),
                   "async/spanning_fraction": (
                       (versions.max(dim=1).values != versions.min(dim=1).values).float()
                       .mean().item())}
        for k in range(self.settings.max_staleness + 1):
            metrics[f"async/staleness_{k}"] = float((oldest == k).sum().item())
        return metrics
