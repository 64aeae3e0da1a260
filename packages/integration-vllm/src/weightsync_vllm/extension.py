"""The vLLM worker extension through which a rollout replica drives the weightsync engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightsync_vllm.transfer_engine import WeightsyncTransferEngine

__all__ = ["WeightsyncWorkerExtension"]


class WeightsyncWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): ``collective_rpc
    ("weightsync_call", args=(method, kwargs))`` runs a weightsync engine method in each
    worker and returns its result (vLLM's weight-transfer calls return nothing, and a sync's
    stages need ``prepare``'s metadata)."""

    def weightsync_call(self, method: str, kwargs: dict[str, Any]) -> Any:
        """Run ``method`` on this worker's weightsync weight-transfer engine."""
        return self._weightsync_engine().call(method, kwargs)

    def weightsync_call_per_rank(self, method: str, per_rank_kwargs: list[dict[str, Any]]
                                 ) -> Any:
        """Run ``method`` on this worker's engine with the arguments of its own rank (its
        tensor-parallel rank: every vLLM worker of a replica is one rank of a sync)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        return self.weightsync_call(method, per_rank_kwargs[get_tensor_model_parallel_rank()])

    def weightsync_begin_stage(self, update_info: dict[str, Any]) -> None:
        """Start phase 1 of a staged sync in the background (the engine's ``begin_stage``)."""
        self._weightsync_engine().begin_stage(update_info)

    def weightsync_stage_status(self) -> dict[str, Any]:
        """How the stage goes (the engine's ``stage_status``)."""
        return self._weightsync_engine().stage_status()

    def weightsync_commit_staged(self) -> dict[str, float]:
        """Phase 2: load the stage (the engine's ``commit_staged``)."""
        return self._weightsync_engine().commit_staged()

    def weightsync_roll_back_commit(self) -> None:
        """Reload the version the last commit replaced."""
        self._weightsync_engine().roll_back_commit()

    def weightsync_roll_back_if_taken(self, version: int | None) -> None:
        """Reload the version replaced where this worker took staged ``version``."""
        self._weightsync_engine().roll_back_if_taken(version)

    def weightsync_discard_staged(self) -> None:
        """Drop the stage."""
        self._weightsync_engine().discard_staged()

    def weightsync_forget_replaced(self) -> None:
        """Drop the copy of the version the last commit replaced."""
        self._weightsync_engine().forget_replaced()

    def weightsync_weights_status(self) -> dict[str, Any]:
        """What this worker serves, has staged and could roll back to."""
        return self._weightsync_engine().weights_status()

    def weightsync_update_adapter(self, global_steps: int, adapter: dict[str, Any],
                                  lora_id: int, delta_base: str | None = None,
                                  delta_version: str | None = None) -> dict[str, float]:
        """Receive one version of a LoRA adapter as LoRA ``lora_id`` (the engine's
        ``update_adapter``: no reload of the model, vLLM serving the other versions)."""
        return self._weightsync_engine().update_adapter(global_steps, adapter, lora_id,
                                                        delta_base, delta_version)

    def weightsync_adapter_status(self) -> dict[str, Any]:
        """The adapter versions this worker holds, by LoRA id, and those retired."""
        return self._weightsync_engine().adapter_status()

    def weightsync_release_adapters(self, lora_ids: list[int]) -> list[int]:
        """Let vLLM go of these retired LoRAs; the ids still retired."""
        return self._weightsync_engine().release_adapters(lora_ids)

    def weightsync_restore_adapters(self) -> None:
        """Add back the adapters vLLM dropped when it reloaded the base weights."""
        self._weightsync_engine().restore_adapters()

    def weightsync_last_stats(self) -> dict[str, float]:
        """What the last update moved (tensors, bytes, seconds)."""
        return dict(self._weightsync_engine().last_stats)

    def _weightsync_engine(self) -> WeightsyncTransferEngine:
        """vLLM's worker's ``weight_transfer_engine``, which must be weightsync's."""
        from weightsync_vllm.transfer_engine import WeightsyncTransferEngine

        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, WeightsyncTransferEngine):
            raise RuntimeError(
                "this vLLM engine's weight transfer is not weightsync's; build it with "
                "weight_transfer_config=WeightTransferConfig(backend='weightsync')"
            )
        return engine
