"""The Ray actor that serves one vLLM engine in its own process (vLLM's ``LLM``) and takes
part in weightsync's syncs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from weightsync_vllm.rollout_worker_base import VLLMRolloutWorkerBase, default_engine_args

__all__ = ["VLLMRolloutWorker", "default_engine_args"]

T = TypeVar("T")


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
        self._engine_calls = threading.Lock()
        """Held by each call into vLLM's engine, from start to end (see :meth:`_one_at_a_time`)."""
        self._llm = self._start_vllm()

    def _start_vllm(self) -> Any:
        """Start vLLM; returns once the model is loaded, so that the actor's readiness is
        vLLM's."""
        from vllm import LLM

        return LLM(**self.engine_args, **self._weight_transfer_args())

    def _one_at_a_time(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``call`` into vLLM's engine once no other call is in it.

        ``LLM`` runs its engine core in the calling thread, so calls from this actor's
        threads would drive vLLM's executor at once. A tensor-parallel engine's executor
        (one message queue to its workers, one reply queue from each) is not made for that:
        two calls at once read each other's replies. That happened after every failed sync
        whose workers were still receiving when the manager sent its ``abort`` (a sharded
        sync, when the sender fails): each later call got the reply of the call before it,
        and the replica never synced again (``locate`` got ``None`` for a host). ``AsyncLLM``
        runs every call in its engine core's one loop, one at a time; this does the same.
        The lock is taken in the thread that calls vLLM, and held until vLLM returns, even
        if the Ray call that started it was cancelled."""
        with self._engine_calls:
            return call(*args, **kwargs)

    async def _rpc_all(self, method: str, /, **kwargs: Any) -> list[Any]:
        return await asyncio.to_thread(self._one_at_a_time, self._llm.collective_rpc, method,
                                       kwargs=kwargs)

    async def _sample(self, prompts: list[dict[str, Any]], params: list[Any],
                      lora_request: Any = None) -> list[list[int]]:
        outputs = await asyncio.to_thread(self._one_at_a_time, self._llm.generate, prompts,
                                          params, use_tqdm=False, lora_request=lora_request)
        return [list(output.outputs[0].token_ids) for output in outputs]

    async def sleep(self) -> None:
        """vLLM's sleep (level 1: weights offloaded, KV cache freed); needs
        ``enable_sleep_mode=True`` in ``engine_args`` (CUDA)."""
        async with self._serving:
            await asyncio.to_thread(self._one_at_a_time, self._llm.sleep, level=1)

    async def wake_up(self) -> None:
        """Undo :meth:`sleep`."""
        async with self._serving:
            await asyncio.to_thread(self._one_at_a_time, self._llm.wake_up)

    def shutdown(self) -> None:
        """Release the weightsync engine's listeners and vLLM's memory."""
        if self._transfer_ready:
            self._one_at_a_time(self._llm.collective_rpc, "shutdown_weight_transfer_engine")
            self._transfer_ready = False
