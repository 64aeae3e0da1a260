"""The Ray actor that serves one vLLM engine as vLLM's servers run it (``AsyncLLM``, its
engine core and its worker in processes of their own) and takes part in weightsync's
syncs."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any

import psutil

from weightsync_vllm.rollout_worker_base import VLLMRolloutWorkerBase

logger = logging.getLogger(__name__)

__all__ = ["AsyncVLLMRolloutWorker"]


class AsyncVLLMRolloutWorker(VLLMRolloutWorkerBase):
    """One vLLM engine (vLLM's ``AsyncLLM``: its engine core in a process of its own, its
    workers in processes of their own, every call between them msgpack) in a Ray actor; each
    vLLM worker is one rank of a sync (with ``tensor_parallel_size`` > 1, drive it through a
    :class:`~weightsync_vllm.tensor_parallel.VLLMReplica`). Pausing and resuming go through
    vLLM's own ``pause_generation`` (waiting for requests in flight, clearing the prefix
    cache computed with the old weights) and ``resume_generation``. See
    :class:`~weightsync_vllm.rollout_worker_base.VLLMRolloutWorkerBase` for the rest. Start
    it with :meth:`start` (vLLM's engine needs the actor's event loop)."""

    _executor_backend = "mp"  # vLLM's workers in processes of their own

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Prepare (vLLM starts in :meth:`start`); the arguments are
        :class:`VLLMRolloutWorkerBase`'s."""
        super().__init__(*args, **kwargs)
        self._llm: Any = None
        self._request_ids = itertools.count()

    async def start(self) -> None:
        """Start vLLM (its engine core and worker); returns once the model is loaded."""
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self._llm is None:
            self._llm = AsyncLLM.from_engine_args(
                AsyncEngineArgs(**self.engine_args, **self._weight_transfer_args())
            )

    @property
    def engine(self) -> Any:
        """vLLM's ``AsyncLLM`` (after :meth:`start`)."""
        if self._llm is None:
            raise RuntimeError("AsyncVLLMRolloutWorker.start() was not called")
        return self._llm

    async def _rpc_all(self, method: str, /, **kwargs: Any) -> list[Any]:
        return await self.engine.collective_rpc(method, kwargs=kwargs)

    async def _sample(self, prompts: list[dict[str, Any]], params: list[Any],
                      lora_request: Any = None) -> list[list[int]]:
        async def one(prompt: dict[str, Any], sampling: Any) -> list[int]:
            final = None
            async for output in self.engine.generate(prompt, sampling,
                                                     f"weightsync-{next(self._request_ids)}",
                                                     lora_request=lora_request):
                final = output
            if final is None:
                raise RuntimeError("vLLM returned no output for a request")
            return list(final.outputs[0].token_ids)

        return list(await asyncio.gather(*map(one, prompts, params)))

    async def _engine_paused(self, paused: bool) -> None:
        if paused:
            await self.engine.pause_generation(mode="wait", clear_cache=True)
        else:
            await self.engine.resume_generation()

    async def shutdown(self) -> None:
        """Release the weightsync engine's listeners, then stop vLLM's processes."""
        if self._llm is None:
            return
        if self._transfer_ready:
            await self._rpc("shutdown_weight_transfer_engine")
            self._transfer_ready = False
        llm, self._llm = self._llm, None
        try:
            llm.shutdown()
        except psutil.NoSuchProcess as exc:
            # vLLM 0.32's kill_process_tree asks each child for its name after listing them:
            # one that exited in between raises, and the rest of the tree is left running
            logger.warning("vLLM's shutdown raced a process that exited (%s); killing the "
                           "rest of its processes", exc)
            _kill_descendants()


def _kill_descendants() -> None:
    """SIGKILL every process this one started (vLLM's engine core and its workers: an
    AsyncLLM's host process starts no others), those that exit meanwhile skipped."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
