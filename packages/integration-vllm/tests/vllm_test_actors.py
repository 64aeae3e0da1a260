"""Actors of the vLLM tests (importable in Ray workers through PYTHONPATH)."""

import asyncio
from collections.abc import Iterator
from typing import Any

import torch

from weightsync_core import AdapterSpec
from weightsync_core.testing.actors import corrupt_bucket_checksum
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

    def corrupt_checksum(self, bucket: int | None) -> None:
        """Announce a wrong checksum for the ``bucket``-th bucket of the next syncs of this
        engine (until it is rebuilt); None: the engine's own checksums again."""
        corrupt_bucket_checksum(self.checkpoint_engine, bucket)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from faulty_stream(dict(super().iter_weights()), self.faults)


class LoRASource(FaultySource):
    """A sender that also trains a LoRA adapter: the tensors the test gives it, PEFT-named."""

    def __init__(self, config, model_path: str, faults: Faults) -> None:
        super().__init__(config, model_path, faults)
        self.adapter: AdapterSpec | None = None
        self.adapter_tensors: dict[str, torch.Tensor] = {}
        self.adapter_faults = Faults()

    def set_adapter(self, spec: dict[str, Any], tensors: dict[str, torch.Tensor],
                    faults: Faults | None = None) -> None:
        """Train adapter ``spec`` (plain data) holding ``tensors``; its syncs misbehave as
        ``faults`` says."""
        self.adapter = AdapterSpec.from_dict(spec)
        self.adapter_tensors = tensors
        self.adapter_faults = faults or Faults()

    def adapter_spec(self, name: str) -> AdapterSpec:
        if self.adapter is None or self.adapter.name != name:
            raise KeyError(f"this actor trains no adapter {name!r}")
        return self.adapter

    def iter_adapter_weights(self, name: str) -> Iterator[tuple[str, torch.Tensor]]:
        self.adapter_spec(name)
        yield from faulty_stream(self.adapter_tensors, self.adapter_faults)


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
        """Make the vLLM worker of tensor-parallel ``rank`` refuse to switch to the next
        stage it prepares."""
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != rank:
            return
        loader = self._weightsync_engine()._loader
        prepare = loader.prepare_weights

        async def prepare_refusing(tensors, version):
            del loader.prepare_weights
            return _RefusingSwitch(await prepare(tensors, version), rank)

        loader.prepare_weights = prepare_refusing


class _RefusingSwitch:
    """A prepared switch whose application a vLLM worker refuses."""

    def __init__(self, switch, rank: int) -> None:
        self.switch, self.rank = switch, rank
        self.nbytes = switch.nbytes

    def apply(self) -> None:
        raise ValueError(f"vLLM worker {self.rank} refused its stage (a test fault)")

    def undo(self) -> None:
        self.switch.undo()

    def release(self) -> None:
        self.switch.release()


class ProbedStagedWorker(StagedAsyncVLLMRolloutWorker):
    """A staged AsyncLLM rollout worker that says whether vLLM's engine is paused, can make
    one of its vLLM workers refuse its next stage, and can hang in its next pause."""

    _worker_extension = "vllm_test_actors.FaultyCommitExtension"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hang_in_next_pause = False

    async def hang_in_next_pause(self) -> None:
        """The next :meth:`pause_generation` never returns (vLLM is never paused: a switch
        that cannot begin), until it is cancelled."""
        self._hang_in_next_pause = True

    async def pause_generation(self, mode: str = "keep") -> None:
        if self._hang_in_next_pause:
            self._hang_in_next_pause = False
            await asyncio.Event().wait()
        await super().pause_generation(mode)

    async def engine_paused(self) -> bool:
        """vLLM's own answer."""
        return await self.engine.is_paused()

    async def refuse_next_commit(self, rank: int) -> None:
        """vLLM worker ``rank`` refuses the next stage it commits."""
        await self._rpc_all("weightsync_refuse_next_commit", rank=rank)
