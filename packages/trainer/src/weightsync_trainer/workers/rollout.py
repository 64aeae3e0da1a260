"""The rollout worker: a Ray actor serving generation and receiving weights via its engine."""

from __future__ import annotations

import os
from typing import Any

import torch

from weightsync_core import CheckpointEngineConfig, CheckpointEngineWorker
from weightsync_trainer.config import ModelConfig
from weightsync_trainer.workers.generation import HFGenerationServer

__all__ = ["RolloutWorker"]


class RolloutWorker(CheckpointEngineWorker):
    """One rollout process: a full model copy behind :class:`HFGenerationServer`, in the
    syncs' ``rollout_dtype``.

    The base class builds the checkpoint engine after importing ``custom_backend_module``.
    """

    def __init__(
        self,
        checkpoint_engine: CheckpointEngineConfig,
        model: ModelConfig,
        temperature: float,
        torch_threads: int = 1,
    ) -> None:
        torch.set_num_threads(torch_threads)
        server = HFGenerationServer(model, temperature,
                                    checkpoint_engine.rollout_torch_dtype)
        super().__init__(checkpoint_engine, server)

    async def generate(
        self, prompt_ids: torch.Tensor, response_length: int, seed: int
    ) -> torch.Tensor:
        """Sample responses for ``prompt_ids`` (``[batch, prompt_length]``)."""
        return await self._server().generate(prompt_ids, response_length, seed)

    def weights_checksum(self) -> str:
        """Digest of the weights this worker serves."""
        return self._server().weights_checksum()

    def _server(self) -> HFGenerationServer:
        return self.server_adapter_of(HFGenerationServer)

    def worker_info(self) -> dict[str, Any]:
        """Process id and the engine class this process built."""
        engine = type(self.checkpoint_engine)
        return {
            "pid": os.getpid(),
            "role": "rollout",
            "engine_class": f"{engine.__module__}.{engine.__qualname__}",
        }
