"""The rollout worker: a Ray actor serving generation and receiving weights via its engine."""

from __future__ import annotations

import os
from typing import Any

import torch

from weightsync_core import CheckpointEngineConfig, CheckpointEngineWorker
from weightsync_trainer.checksum import weights_digest
from weightsync_trainer.config import ModelConfig
from weightsync_trainer.workers.generation import HFGenerationServer
from weightsync_trainer.workers.tensor_parallel import TensorParallelGenerationServer

__all__ = ["RolloutWorker"]


class RolloutWorker(CheckpointEngineWorker):
    """One rollout process: a full model copy behind :class:`HFGenerationServer`, in the
    syncs' ``rollout_dtype`` (or one tensor-parallel rank of a replica's model).

    The base class builds the checkpoint engine after importing ``custom_backend_module``.
    """

    def __init__(
        self,
        checkpoint_engine: CheckpointEngineConfig,
        model: ModelConfig,
        temperature: float,
        torch_threads: int = 1,
        tensor_parallel: tuple[int, int] | None = None,
    ) -> None:
        """``tensor_parallel``: ``(size, rank)`` of a worker that receives only its
        tensor-parallel slices (:class:`TensorParallelGenerationServer`)."""
        torch.set_num_threads(torch_threads)
        dtype = checkpoint_engine.rollout_torch_dtype
        server = (HFGenerationServer(model, temperature, dtype) if tensor_parallel is None
                  else TensorParallelGenerationServer(model, temperature, dtype,
                                                      *tensor_parallel))
        super().__init__(checkpoint_engine, server)

    async def generate(
        self, prompt_ids: torch.Tensor, response_length: int, seed: int,
        adapter: tuple[str, int] | None = None,
    ) -> torch.Tensor:
        """Sample responses for ``prompt_ids`` (``[batch, prompt_length]``), on LoRA
        adapter version ``adapter`` (``(name, version)``) where given."""
        return await self._server().generate(prompt_ids, response_length, seed, adapter)

    async def generate_sample(
        self, prompt_ids: torch.Tensor, response_length: int, seed: int,
        adapter: tuple[str, int] | None = None,
    ) -> dict[str, Any]:
        """Sample responses for ``prompt_ids``, with each token's weights version and time
        (:meth:`HFGenerationServer.generate_sample`)."""
        return await self._server().generate_sample(prompt_ids, response_length, seed,
                                                    adapter)

    async def weights_checksum(self) -> str:
        """Digest of the weights this worker serves (a tensor-parallel worker's: the whole
        model, assembled from its replica's slices)."""
        server = self._server()
        if isinstance(server, TensorParallelGenerationServer):
            await server.make_whole()
        return server.weights_checksum()

    def adapter_checksum(self, name: str, version: int) -> str:
        """Digest of ``version`` of LoRA adapter ``name`` as this worker serves it (compare
        with the actor's ``adapter_checksum``)."""
        return weights_digest(self._server().adapters.tensors(name, version).items())

    def set_tensor_parallel_peers(self, peers: list[Any]) -> None:
        """The other workers of this tensor-parallel replica."""
        self.server_adapter_of(TensorParallelGenerationServer).set_peers(peers)

    def tensor_parallel_slices(self) -> Any:
        """This tensor-parallel worker's weights version and slices (for its peers)."""
        return self.server_adapter_of(TensorParallelGenerationServer).tensor_parallel_slices()

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
