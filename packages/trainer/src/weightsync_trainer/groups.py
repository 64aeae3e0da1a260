"""Ray worker groups of the training roles (``actor_wg`` and the critic group)."""

from __future__ import annotations

import asyncio
from typing import Any

import ray
import torch

from weightsync_core import RayWorkerGroup
from weightsync_trainer.config import TrainingWorkerConfig

__all__ = ["TrainingWorkerGroup"]

Batch = dict[str, torch.Tensor]


class TrainingWorkerGroup(RayWorkerGroup):
    """The ranks of one training role as Ray actors; a :class:`RayWorkerGroup`, so the
    checkpoint-engine manager drives it directly (the trainer's ``actor_wg``)."""

    @classmethod
    def spawn(
        cls, worker_cls: type, config: TrainingWorkerConfig, actor_options: dict[str, Any]
    ) -> TrainingWorkerGroup:
        """Start ``config.world_size`` actors of ``worker_cls`` (``ray.remote`` options given)."""
        remote = ray.remote(**actor_options)(worker_cls)
        return cls([remote.remote(config, rank) for rank in range(config.world_size)])

    async def init_model(self) -> None:
        """Rendezvous at rank 0's address and build the sharded model on every rank."""
        address, port = await self.workers[0].master_address.remote()
        await asyncio.gather(*(w.init_model.remote(address, port) for w in self.workers))

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call ``method`` with the same arguments on every rank."""
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def call_split(
        self, method: str, batch: Batch | torch.Tensor, **kwargs: Any
    ) -> list[ray.ObjectRef]:
        """Call ``method`` on every rank with its equal share (rows) of ``batch``."""
        if isinstance(batch, torch.Tensor):
            shares = batch.chunk(self.world_size)
        else:
            chunks = {key: value.chunk(self.world_size) for key, value in batch.items()}
            shares = [{key: parts[rank] for key, parts in chunks.items()}
                      for rank in range(self.world_size)]
        if len(shares) != self.world_size:
            raise ValueError(f"a batch of {len(batch)} rows cannot feed {self.world_size} ranks")
        return [getattr(w, method).remote(share, **kwargs)
                for w, share in zip(self.workers, shares, strict=True)]

    def kill(self) -> None:
        """Stop every rank."""
        for worker in self.workers:
            ray.kill(worker)
