"""Actors of the vLLM tests (importable in Ray workers through PYTHONPATH)."""

from collections.abc import Iterator

import torch

from weightsync_core.testing.weights import Faults, faulty_stream
from weightsync_vllm.async_worker import AsyncVLLMRolloutWorker
from weightsync_vllm.extension import WeightsyncWorkerExtension
from weightsync_vllm.model_source import ModelWeightsSource
from weightsync_vllm.staged_worker import StagedAsyncVLLMRolloutWorker


class FaultySource(ModelWeightsSource):
    """A sender that fails part-way through its weights, as ``faults`` says."""

    def __init__(self, config, model_path: str, faults: Faults) -> None:
        super().__init__(config, model_path)
        self.faults = faults

    def tensor_names(self) -> list[str]:
        """The names of the weights it sends when nothing misbehaves, in order."""
        return [name for name, _ in super().iter_weights()]

    def set_faults(self, faults: Faults) -> None:
        """Misbehave as ``faults`` says from the next sync on."""
        self.faults = faults

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from faulty_stream(dict(super().iter_weights()), self.faults)


class ProbedAsyncWorker(AsyncVLLMRolloutWorker):
    """An AsyncLLM rollout worker that can also generate past its own refusal, to show that
    vLLM's engine still runs after a failed sync."""

    async def generate_anyway(self, prompt_ids: torch.Tensor, response_length: int
                              ) -> torch.Tensor:
        from vllm import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=response_length,
                                 min_tokens=response_length, ignore_eos=True,
                                 detokenize=False) for _ in range(prompt_ids.shape[0])]
        prompts = [{"prompt_token_ids": row.tolist()} for row in prompt_ids]
        return torch.tensor(await self._sample(prompts, params), dtype=prompt_ids.dtype)

    async def engine_paused(self) -> bool:
        """vLLM's own answer."""
        return await self.engine.is_paused()


class FaultyCommitExtension(WeightsyncWorkerExtension):
    """weightsync's extension of vLLM's workers, able to make one worker refuse a stage."""

    def weightsync_refuse_next_commit(self, rank: int) -> None:
        """Make the vLLM worker of tensor-parallel ``rank`` refuse the next stage it loads."""
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != rank:
            return
        loader = self._weightsync_engine()._loader

        async def refuse(weights, global_steps=None) -> None:
            del loader.update_weights
            raise ValueError(f"vLLM worker {rank} refused its stage (a test fault)")

        loader.update_weights = refuse


class ProbedStagedWorker(StagedAsyncVLLMRolloutWorker):
    """A staged AsyncLLM rollout worker that says whether vLLM's engine is paused, and can
    make one of its vLLM workers refuse its next stage."""

    _worker_extension = "vllm_test_actors.FaultyCommitExtension"

    async def engine_paused(self) -> bool:
        """vLLM's own answer."""
        return await self.engine.is_paused()

    async def refuse_next_commit(self, rank: int) -> None:
        """vLLM worker ``rank`` refuses the next stage it commits."""
        await self._rpc_all("weightsync_refuse_next_commit", rank=rank)
