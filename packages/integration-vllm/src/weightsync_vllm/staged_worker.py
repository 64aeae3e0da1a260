"""An ``AsyncLLM`` rollout worker whose syncs are staged: vLLM keeps generating while the
next version streams into a stage in its worker process, and pauses only to load it."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from weightsync_core import WeightSyncError, switch_paused
from weightsync_vllm.async_worker import AsyncVLLMRolloutWorker
from weightsync_vllm.rollout_worker_base import one_per_rank

__all__ = ["StagedAsyncVLLMRolloutWorker"]

_POLL_SECONDS = 0.02
"""How often the actor asks vLLM's worker whether its stage is complete (each question is a
short ``collective_rpc`` between two of the engine's steps)."""

_VLLM_PAUSE_MODES = {"keep": "keep", "drain": "wait", "abort": "abort"}
"""weightsync's pause modes as vLLM's ``pause_generation`` names them."""


class StagedAsyncVLLMRolloutWorker(AsyncVLLMRolloutWorker):
    """:class:`~weightsync_vllm.async_worker.AsyncVLLMRolloutWorker` taking part in staged
    syncs (weightsync-core's manager stages wherever every worker can, so a replica of this
    worker gets them from ``update_weights``).

    Phase 1 (:meth:`stage_weights`): vLLM's worker receives and checks the version into a
    host stage on a loop of its own (the engine's other stages, short, still run between
    two of vLLM's steps), each tensor checked against the model's names, shapes and dtypes,
    then loaded and processed into a shadow of the model
    (:mod:`weightsync_vllm.prepared_switch`); the actor polls it; vLLM generates
    throughout. Phase 2 (:meth:`switch_to_staged`): vLLM's ``pause_generation`` (``keep``:
    requests in flight freeze with their KV cache and continue on the new weights;
    ``drain``: vLLM's ``wait``; ``abort``), the shadow's tensors put in the model's place,
    and ``resume_generation``; all or nothing, so vLLM serves one version whatever fails.
    Requests carry a cache salt of the version they started on, so no new request reuses a
    prefix cached under other weights (the cache is never cleared).

    vLLM's worker keeps, besides the model: the stage (M, host, from its arrival to the
    commit), the shadow (K + P, from the stage's end to the commit) and the replaced version
    (K + P, during the switch), M being the model in the sync's rollout dtype, K and P the
    model's tensors and what vLLM's processing builds besides (packed weights); each vLLM
    worker of a tensor-parallel engine the same, for the full copy it receives, or its
    slices over a sharded backend. Put it in a
    :class:`~weightsync_vllm.tensor_parallel.StagedVLLMReplica` (any
    ``tensor_parallel_size``; a ``RayRolloutReplica`` takes one vLLM worker only).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """As :class:`~weightsync_vllm.async_worker.AsyncVLLMRolloutWorker`."""
        super().__init__(*args, **kwargs)
        self.staged_version: int | None = None
        self.rollback_version: int | None = None

    async def stage_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        delta_base: str | None = None, delta_version: str | None = None,
    ) -> dict[str, float]:
        """Phase 1: receive and check one version into vLLM's worker's stage while vLLM
        serves; returns the stage's figures (one vLLM worker: see
        :meth:`stage_weights_per_rank`)."""
        self._check_single_rank("stage_weights")
        return (await self._stage(global_steps, allow_manifest_change, delta_base,
                                  delta_version))[0]

    async def stage_weights_per_rank(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        delta_base: str | None = None, delta_version: str | None = None,
    ) -> Any:
        """:meth:`stage_weights`, every vLLM worker staging as a rank of its own (a
        :class:`~weightsync_vllm.tensor_parallel.StagedVLLMReplica`); each worker's
        figures in rank order."""
        return one_per_rank(await self._stage(global_steps, allow_manifest_change,
                                               delta_base, delta_version))

    async def _stage(self, global_steps: int | None, allow_manifest_change: bool,
                     delta_base: str | None, delta_version: str | None
                     ) -> list[dict[str, float]]:
        await self._ensure_transfer_engine()
        self.staged_version = None
        await self._rpc("weightsync_begin_stage", update_info={
            "global_steps": global_steps, "allow_manifest_change": allow_manifest_change,
            "delta_base": delta_base, "delta_version": delta_version,
        })
        while True:  # every worker asked at once, until all are done (or one failed)
            statuses = await self._rpc_all("weightsync_stage_status")
            if all(status.pop("done") for status in statuses):
                self.staged_version = global_steps
                return statuses
            await asyncio.sleep(_POLL_SECONDS)

    async def pause_generation(self, mode: str = "keep") -> None:
        """Pause vLLM for a switch (``keep``, ``drain`` or ``abort``), its caches kept."""
        if mode not in _VLLM_PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {sorted(_VLLM_PAUSE_MODES)}, got "
                             f"{mode!r}")
        await self.engine.pause_generation(mode=_VLLM_PAUSE_MODES[mode], clear_cache=False)

    async def commit_staged(self) -> dict[str, float]:
        """Phase 2 under the caller's pause: every vLLM worker switches to its stage; where
        one refuses, those that took theirs roll back (the engine serves one version).
        Returns rank 0's figures."""
        return await self._commit(take_status=True)

    async def _commit(self, take_status: bool) -> dict[str, float]:
        """:meth:`commit_staged`; where every vLLM worker took its stage and not
        ``take_status``, only the version served is set here (the requests' cache salt),
        and the caller asks the workers for the rest once vLLM runs again."""
        version = self.staged_version
        try:
            stats = await self._rpc("weightsync_commit_staged")
        except BaseException:
            if self.tensor_parallel_size > 1:
                await self._rpc("weightsync_roll_back_if_taken", version=version)
            await self._take_status()
            raise
        if take_status:
            await self._take_status()
        else:
            self.update_complete, self.weights_version = True, version
        return stats

    async def roll_back_commit(self) -> None:
        """Reload the version the last commit replaced."""
        try:
            await self._rpc("weightsync_roll_back_commit")
        finally:
            await self._take_status()

    async def discard_staged(self) -> None:
        """Drop the stage."""
        await self._rpc("weightsync_discard_staged")
        self.staged_version = None

    async def switch_to_staged(self, mode: str = "keep", timeout_seconds: float | None = None
                               ) -> dict[str, float]:
        """Phase 2 of a replica of this one worker: pause, commit, resume (unless vLLM holds
        a mix of versions, which :meth:`generate` then refuses to serve); the pause and the
        commit may take ``timeout_seconds`` together (``weightsync_core.switch_paused``)."""
        try:
            stats = await switch_paused(lambda: self.pause_generation(mode),
                                        lambda: self._commit(take_status=False),
                                        self.resume_generation, lambda: self.update_complete,
                                        timeout_seconds)
        except WeightSyncError:
            await self.discard_staged()  # given up before the commit took it
            raise
        await self.forget_replaced()  # no other worker of its replica can fail
        await self._take_status()
        return stats

    async def forget_replaced(self) -> None:
        """Drop vLLM's worker's copy of the version the last commit replaced (every worker of
        the replica took its stage)."""
        await self._rpc("weightsync_forget_replaced")

    async def _take_status(self) -> None:
        """What vLLM's workers serve after a commit or a roll-back: the version they agree
        on (complete only where every one is whole on the same version)."""
        statuses = await self._rpc_all("weightsync_weights_status")
        versions = {status["version"] for status in statuses}
        self.update_complete = len(versions) == 1 and all(s["complete"] for s in statuses)
        self.weights_version = statuses[0]["version"]
        self.staged_version = statuses[0]["staged_version"]
        self.rollback_version = statuses[0]["rollback_version"]

    async def weights_status_of_rank(self, rank: int) -> dict[str, Any]:
        """vLLM worker ``rank``'s own status (its weightsync worker's ``weights_status``:
        version, whether whole, staged and rollback versions)."""
        return (await self._rpc_all("weightsync_weights_status"))[rank]

    def weights_status(self) -> dict[str, Any]:
        """``{"version", "complete", "staged_version", "rollback_version"}``."""
        return {**super().weights_status(), "staged_version": self.staged_version,
                "rollback_version": self.rollback_version}

    def _prompt(self, token_ids: torch.Tensor) -> dict[str, Any]:
        return {**super()._prompt(token_ids), "cache_salt": f"weights-{self.weights_version}"}
