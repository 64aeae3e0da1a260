"""The Ray actor that serves one vLLM engine in its own process (vLLM's ``LLM``) and takes
part in weightsync's syncs."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from weightsync_vllm.rollout_worker_base import VLLMRolloutWorkerBase, default_engine_args

__all__ = ["VLLMRolloutWorker", "default_engine_args"]


class VLLMRolloutWorker(VLLMRolloutWorkerBase):
    """One vLLM engine (vLLM's ``LLM``, in this process: no engine-core or worker process to
    spawn, so it starts in seconds) in a Ray actor; one rank of a sync. See
    :class:`~weightsync_vllm.rollout_worker_base.VLLMRolloutWorkerBase` for what it does;
    :class:`~weightsync_vllm.async_worker.AsyncVLLMRolloutWorker` runs vLLM as servers do."""

    # vLLM's engine core and worker in this process
    _vllm_env: ClassVar[dict[str, str]] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Start vLLM; the arguments are :class:`VLLMRolloutWorkerBase`'s."""
        super().__init__(*args, **kwargs)
        self._llm = self._start_vllm()

    def _start_vllm(self) -> Any:
        """Start vLLM; returns once the model is loaded, so that the actor's readiness is
        vLLM's."""
        from vllm import LLM

        return LLM(**self.engine_args, **self._weight_transfer_args())

    async def _rpc_all(self, method: str, /, **kwargs: Any) -> list[Any]:
        return await asyncio.to_thread(self._llm.collective_rpc, method, kwargs=kwargs)

    async def _sample(self, prompts: list[dict[str, Any]], params: list[Any]
                      ) -> list[list[int]]:
        outputs = await asyncio.to_thread(self._llm.generate, prompts, params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    async def sleep(self) -> None:
        """vLLM's sleep (level 1: weights offloaded, KV cache freed); needs
        ``enable_sleep_mode=True`` in ``engine_args`` (CUDA)."""
        async with self._serving:
            await asyncio.to_thread(self._llm.sleep, level=1)

    async def wake_up(self) -> None:
        """Undo :meth:`sleep`."""
        async with self._serving:
            await asyncio.to_thread(self._llm.wake_up)

    def shutdown(self) -> None:
        """Release the weightsync engine's listeners and vLLM's memory."""
        if self._transfer_ready:
            self._llm.collective_rpc("shutdown_weight_transfer_engine")
            self._transfer_ready = False
