"""What every vLLM rollout worker does, whichever vLLM front end it runs: take part in
weightsync's syncs through vLLM's weight-transfer calls, and refuse to serve weights a sync
left incomplete."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any, ClassVar

import torch

from weightsync_core import ADAPTER_KEEP, CheckpointEngineConfig, WeightSyncError
from weightsync_core.spi import default_host
from weightsync_vllm.adapter_requests import ServedAdapters
from weightsync_vllm.stage_arguments import plain_arguments

__all__ = ["VLLMRolloutWorkerBase", "default_engine_args", "one_per_rank"]


def default_engine_args(model_path: str) -> dict[str, Any]:
    """vLLM engine arguments for a weightsync rollout worker serving ``model_path`` (a
    directory holding the model's config and safetensors): float32, no tokenizer (requests
    are token ids), eager mode. Override any of them through ``engine_args``."""
    return {
        "model": model_path,
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "enforce_eager": True,
        "seed": 0,
    }


class VLLMRolloutWorkerBase:
    """One vLLM engine in a Ray actor, each of its vLLM workers one rank of a sync (one with
    ``tensor_parallel_size=1``, a :class:`~weightsync_vllm.tensor_parallel.VLLMReplica` of
    several otherwise: every worker receives the full weights, and vLLM's loaders keep each
    worker's shard). Subclasses run vLLM (``_rpc_all``, ``_sample``).

    The weightsync engine is vLLM's weight-transfer engine
    (``weight_transfer_config=WeightTransferConfig(backend="weightsync")``); this actor
    forwards the manager's calls to it: engine stages through ``collective_rpc``, the transfer
    through vLLM's ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``.
    Generation and updates never overlap (one lock); a sync pauses the worker (generation
    refused) until it completes. After a failed sync the worker stays paused,
    :meth:`weights_status` reports the update incomplete and :meth:`generate` refuses to serve
    until a sync succeeds (vLLM's model holds a mix of versions then; weightsync's engine has
    ended vLLM's reload cleanly, so vLLM itself keeps running).

    LoRA adapter syncs (``update_weights(..., adapter=spec)``, from weightsync's
    ``CheckpointEngineManager.update_adapter``) add a version of the adapter beside those
    vLLM serves, in memory, without vLLM's weight-update calls and without a pause; the
    engine needs ``enable_lora=True`` and ``max_cpu_loras`` of at least ``adapter_versions
    + 1`` per adapter name (``engine_args``). :meth:`generate` serves on a version the
    engine holds (``adapter=(name, version)``); a version the manager drops stays in vLLM
    until the requests in flight on it end.

    Args:
        config: how weights reach this worker (backend, timeout, verification, ...).
        model_path: the model directory vLLM loads at start.
        engine_args: vLLM engine arguments overriding :func:`default_engine_args`.
        temperature: sampling temperature of :meth:`generate`.
        env: environment variables set before vLLM starts (e.g. ``VLLM_CPU_KVCACHE_SPACE``).
    """

    _executor_backend: str = "uni"
    """vLLM's ``distributed_executor_backend`` unless ``engine_args`` says otherwise."""
    _vllm_env: ClassVar[dict[str, str]] = {}
    """Environment variables the subclass's way of running vLLM needs."""

    def __init__(
        self,
        config: CheckpointEngineConfig,
        model_path: str,
        engine_args: dict[str, Any] | None = None,
        temperature: float = 1.0,
        env: dict[str, str] | None = None,
    ) -> None:
        os.environ.update({**self._vllm_env, **(env or {})})
        # transports listen on this Ray node's address
        os.environ.setdefault("WEIGHTSYNC_HOST", default_host())
        self.config = config
        self.engine_args = {**default_engine_args(model_path),
                            "distributed_executor_backend": self._executor_backend,
                            **(engine_args or {})}
        if self.engine_args.get("pipeline_parallel_size", 1) != 1:
            raise ValueError(
                f"a {type(self).__name__} loads full copies into every vLLM worker; "
                "pipeline_parallel_size must be 1 (tensor_parallel_size may be more)"
            )
        self.tensor_parallel_size = int(self.engine_args.get("tensor_parallel_size", 1))
        """vLLM workers of this engine: each is one rank of a sync (see
        :class:`~weightsync_vllm.tensor_parallel.VLLMReplica`)."""
        executor = "distributed_executor_backend"
        if self.tensor_parallel_size > 1 and self.engine_args[executor] == "uni":
            self.engine_args[executor] = "mp"  # "uni" runs one worker
        self.temperature = temperature
        self.weights_version: int | None = None
        self.update_complete = True
        self.paused = False
        self._transfer_ready = False
        self.last_updates: list[dict[str, float]] = []
        """What the last complete update moved into each vLLM worker, in rank order."""
        self._serving = asyncio.Lock()  # generation and weight updates take turns
        self.adapters = ServedAdapters()
        """The LoRA adapter versions requests may name, and those in use."""

    _worker_extension: ClassVar[str] = "weightsync_vllm.extension.WeightsyncWorkerExtension"
    """vLLM's ``worker_extension_cls``: how the actor reaches weightsync in vLLM's workers
    (a subclass of :class:`~weightsync_vllm.extension.WeightsyncWorkerExtension`)."""

    @classmethod
    def _weight_transfer_args(cls) -> dict[str, Any]:
        """The engine arguments that make weightsync vLLM's weight-transfer engine."""
        from vllm.config import WeightTransferConfig

        from weightsync_vllm.plugin import BACKEND_NAME

        return {
            "weight_transfer_config": WeightTransferConfig(backend=BACKEND_NAME),
            "worker_extension_cls": cls._worker_extension,
        }

    async def _rpc_all(self, method: str, /, **kwargs: Any) -> list[Any]:
        """vLLM's ``collective_rpc`` of ``method`` on its workers; every worker's result, in
        rank order."""
        raise NotImplementedError

    async def _rpc(self, method: str, /, **kwargs: Any) -> Any:
        """vLLM's ``collective_rpc`` of ``method`` on its workers; rank 0's result (every
        worker ran it)."""
        return (await self._rpc_all(method, **kwargs))[0]

    async def _sample(self, prompts: list[dict[str, Any]], params: list[Any],
                      lora_request: Any = None) -> list[list[int]]:
        """The token ids vLLM samples for each prompt with its ``SamplingParams`` (on the
        LoRA of ``lora_request``, a ``LoRARequest`` of a version held, if given)."""
        raise NotImplementedError

    async def _engine_paused(self, paused: bool) -> None:
        """Tell vLLM's engine the worker pauses or resumes (nothing by default)."""

    async def _ensure_transfer_engine(self) -> None:
        if not self._transfer_ready:
            await self._rpc("init_weight_transfer_engine",
                            init_info=dataclasses.asdict(self.config))
            self._transfer_ready = True

    async def set_checkpoint_engine(self, config: CheckpointEngineConfig) -> None:
        """Receive later syncs with ``config`` (another backend, timeout, ...): the
        weightsync engine in vLLM's worker is rebuilt (unless ``config`` is the current one)."""
        if config != self.config or not self._transfer_ready:
            self.config = config
            self._transfer_ready = False
            await self._ensure_transfer_engine()

    def _check_single_rank(self, call: str) -> None:
        """Refuse a one-rank call (a plain ``RayRolloutReplica``'s) when this engine's vLLM
        workers are several ranks: each would act as the same rank of the sync."""
        if self.tensor_parallel_size > 1:
            raise WeightSyncError(
                f"{call} drives one rank, but this vLLM engine runs "
                f"{self.tensor_parallel_size} workers, each a rank of its own: put the actor "
                f"in a VLLMReplica(actor, tensor_parallel_size={self.tensor_parallel_size}) "
                "instead of a RayRolloutReplica"
            )

    async def execute_checkpoint_engine(self, method: str, **kwargs: Any) -> Any:
        """Run one weightsync engine method in vLLM's worker (an engine of one vLLM worker;
        see :meth:`execute_checkpoint_engine_per_rank`)."""
        self._check_single_rank(f"execute_checkpoint_engine({method!r})")
        await self._ensure_transfer_engine()
        # plain data: vLLM's processes pass it as MessagePack (no torch.dtype in kimi's plan)
        result = await self._rpc("weightsync_call", method=method,
                                 kwargs=plain_arguments(kwargs))
        if method == ADAPTER_KEEP:
            await self._take_adapter_status()
        return result

    async def execute_checkpoint_engine_per_rank(
        self, method: str, per_rank_kwargs: list[dict[str, Any]]
    ) -> Any:
        """Run one weightsync engine method in each vLLM worker, worker ``i`` with
        ``per_rank_kwargs[i]``; the results in rank order, one per worker (as Ray's
        ``num_returns`` expects: a tuple, or the one result of a single worker)."""
        if len(per_rank_kwargs) != self.tensor_parallel_size:
            raise WeightSyncError(
                f"{len(per_rank_kwargs)} ranks' arguments for {method}, but this vLLM engine "
                f"has {self.tensor_parallel_size} workers: build its VLLMReplica with "
                f"tensor_parallel_size={self.tensor_parallel_size}"
            )
        await self._ensure_transfer_engine()
        results = await self._rpc_all("weightsync_call_per_rank", method=method,
                                      per_rank_kwargs=plain_arguments(per_rank_kwargs))
        if method == ADAPTER_KEEP:
            await self._take_adapter_status()
        return one_per_rank(results)

    async def update_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        delta_base: str | None = None, delta_version: str | None = None,
        adapter: dict[str, Any] | None = None,
    ) -> dict[str, float]:
        """Receive one version of the weights into vLLM's model through vLLM's
        weight-transfer calls, with weightsync as the engine (an engine of one vLLM worker;
        see :meth:`update_weights_per_rank`). With ``adapter`` (an adapter sync: the
        adapter's spec as plain data), version ``global_steps`` of that LoRA adapter instead
        (:meth:`update_adapter_per_rank`)."""
        self._check_single_rank("update_weights")
        if adapter is not None:
            return (await self._update_adapter(global_steps, adapter, delta_base,
                                               delta_version))[0]
        return (await self._update(global_steps, allow_manifest_change, delta_base,
                                   delta_version))[0]

    async def update_weights_per_rank(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        delta_base: str | None = None, delta_version: str | None = None,
        adapter: dict[str, Any] | None = None,
    ) -> Any:
        """:meth:`update_weights`, every vLLM worker receiving as a rank of its own; each
        worker's figures in rank order (as :meth:`execute_checkpoint_engine_per_rank`)."""
        if adapter is not None:
            return await self.update_adapter_per_rank(global_steps, adapter, delta_base,
                                                      delta_version)
        return one_per_rank(await self._update(global_steps, allow_manifest_change,
                                                delta_base, delta_version))

    async def update_adapter_per_rank(
        self, global_steps: int | None, adapter: dict[str, Any],
        delta_base: str | None = None, delta_version: str | None = None,
    ) -> Any:
        """Receive version ``global_steps`` of the LoRA adapter ``adapter`` into every vLLM
        worker, each a rank of the sync (not through vLLM's weight-update calls, which
        reload the model; nothing paused: the versions served keep serving). Requests may
        name the version once every worker holds it. Each worker's figures in rank
        order."""
        return one_per_rank(await self._update_adapter(global_steps, adapter, delta_base,
                                                       delta_version))

    async def _update_adapter(
        self, global_steps: int | None, adapter: dict[str, Any],
        delta_base: str | None, delta_version: str | None,
    ) -> list[dict[str, float]]:
        await self._ensure_transfer_engine()
        stats = await self._rpc_all(
            "weightsync_update_adapter", global_steps=global_steps, adapter=adapter,
            lora_id=self.adapters.new_id(), delta_base=delta_base,
            delta_version=delta_version)
        await self._take_adapter_status()
        return stats

    async def _take_adapter_status(self) -> None:
        """Learn which adapter versions every vLLM worker holds (those requests may name),
        and let vLLM go of the dropped ones no request in flight uses."""
        self.adapters.take(await self._rpc_all("weightsync_adapter_status"))
        await self._release_adapters()

    async def _release_adapters(self) -> None:
        releasable = self.adapters.releasable()
        if releasable:
            self.adapters.still_retired(
                await self._rpc_all("weightsync_release_adapters", lora_ids=releasable))

    async def _update(
        self, global_steps: int | None, allow_manifest_change: bool,
        delta_base: str | None = None, delta_version: str | None = None,
    ) -> list[dict[str, float]]:
        await self._ensure_transfer_engine()
        async with self._serving:
            self.update_complete = False
            await self._rpc("start_weight_update")
            await self._rpc("update_weights", update_info={
                "global_steps": global_steps, "allow_manifest_change": allow_manifest_change,
                "delta_base": delta_base, "delta_version": delta_version,
            })
            await self._rpc("finish_weight_update")
            await self._rpc("weightsync_restore_adapters")  # vLLM dropped them
            self.weights_version = global_steps
            self.update_complete = True
        stats = await self._rpc_all("weightsync_last_stats")
        self.last_updates = stats
        return stats

    def last_update_stats(self, worker: int = 0) -> dict[str, float]:
        """What the last complete update moved into vLLM worker ``worker`` (its
        tensor-parallel rank: ``nbytes``, ``num_tensors``, ...) and the seconds vLLM spent
        loading it (``load_seconds`` in ``load_weights``, ``finish_seconds`` processing at
        the end); empty before the first."""
        return dict(self.last_updates[worker]) if self.last_updates else {}

    def weights_status(self) -> dict[str, Any]:
        """``{"version": ..., "complete": ..., "adapters": ...}`` of the weights this worker
        serves (``adapters``: per LoRA adapter name, the versions requests may name, oldest
        first)."""
        return {"version": self.weights_version, "complete": self.update_complete,
                "adapters": self.adapters.versions()}

    async def weights_status_of_rank(self, rank: int) -> dict[str, Any]:
        """What vLLM worker ``rank`` serves (a
        :class:`~weightsync_vllm.tensor_parallel.VLLMWorkerRank`'s ``weights_status``):
        the engine's, whose workers load together."""
        del rank
        return self.weights_status()

    async def generate(
        self, prompt_ids: torch.Tensor, response_length: int, seed: int,
        adapter: tuple[str, int] | None = None,
    ) -> torch.Tensor:
        """Sample exactly ``response_length`` tokens after each row of ``prompt_ids``
        (``[batch, prompt_length]``); ``temperature`` 0 is greedy. Returns
        ``[batch, response_length]`` token ids. ``adapter``: ``(name, version)`` of a LoRA
        adapter version this engine holds (:meth:`weights_status`'s ``adapters``) to serve
        on; None: the base model.

        Raises:
            WeightSyncError: the last weight update did not complete, the replica is
                paused, or it holds no such adapter version (refused before vLLM sees the
                request: vLLM would try to load it from disk, and its engine would die).
        """
        from vllm import SamplingParams

        async with self._serving:
            self._check_serving()
            params = [SamplingParams(
                temperature=self.temperature, max_tokens=response_length,
                min_tokens=response_length, ignore_eos=True, seed=seed + index,
                detokenize=False,
            ) for index in range(prompt_ids.shape[0])]
            prompts = [self._prompt(row) for row in prompt_ids]
            lora = self.adapters.request(adapter)
            try:
                tokens = await self._sample(prompts, params, lora)
            finally:
                self.adapters.finished(lora)
                await self._release_adapters()
        return torch.tensor(tokens, dtype=prompt_ids.dtype)

    def _prompt(self, token_ids: torch.Tensor) -> dict[str, Any]:
        """vLLM's prompt of one row of token ids."""
        return {"prompt_token_ids": token_ids.tolist()}

    def _check_serving(self) -> None:
        if not self.update_complete:
            raise WeightSyncError(
                "this vLLM replica's last weight update did not complete: it holds a mix of "
                "old and new weights and does not serve until a sync succeeds"
            )
        if self.paused:
            raise WeightSyncError(
                "this vLLM replica is paused for a weight sync; it serves again after "
                "resume_generation"
            )

    async def abort_all_requests(self) -> None:
        """Pause: new requests are refused; a generation in flight finishes first."""
        async with self._serving:
            self.paused = True
            await self._engine_paused(True)

    async def resume_generation(self) -> None:
        """Serve again after a complete sync."""
        self.paused = False
        await self._engine_paused(False)

    def is_paused(self) -> bool:
        """Whether requests are refused (during a sync, and after a failed one)."""
        return self.paused

    async def reload_from_disk(self, directory: str) -> None:
        """Load the safetensors in ``directory`` into the model (vLLM's own
        ``reload_weights``): the way to update weights without weightsync, the benchmarks'
        baseline."""
        async with self._serving:
            await self._rpc("reload_weights", weights_path=directory)
            await self._rpc("weightsync_restore_adapters")  # vLLM dropped them

    async def release_kv_cache(self) -> None:
        """Nothing: the KV cache stays allocated during a sync (vLLM frees it only through
        its CUDA sleep mode, which also releases the weights being updated)."""

    async def resume_kv_cache(self) -> None:
        """Nothing (see :meth:`release_kv_cache`)."""


def one_per_rank(results: list[Any]) -> Any:
    """``results`` as a Ray method with ``num_returns=len(results)`` returns them."""
    return results[0] if len(results) == 1 else tuple(results)
