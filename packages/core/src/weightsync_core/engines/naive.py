"""The ``naive`` engine: actor and rollout live in the same process, nothing is moved."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import torch

from weightsync_core.api.engine import CheckpointEngine, TransferStats
from weightsync_core.api.errors import WeightSyncError
from weightsync_core.api.registry import CheckpointEngineRegistry
from weightsync_core.data.bucketing import WeightsSource, cast_for_rollout, iter_named_tensors

__all__ = ["ColocatedCheckpointEngine"]


@CheckpointEngineRegistry.register("naive")
class ColocatedCheckpointEngine(CheckpointEngine):
    """Hands the actor's weight iterator straight to the colocated rollout server.

    ``send_weights`` stores the iterator; ``receive_weights`` (in the same process) iterates it,
    validating names and types and applying ``rollout_dtype``.
    """

    is_colocated = True

    _weights: WeightsSource | None = None
    """The actor's weights, handed from ``send_weights`` to ``receive_weights``."""

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    async def send_weights(
        self, weights: WeightsSource, global_steps: int | None = None
    ) -> TransferStats:
        self._weights = weights
        return TransferStats()

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if self._weights is None:
            raise WeightSyncError(
                "naive engine: receive_weights called before send_weights in this process; "
                "the colocated engine needs the actor's weights first"
            )
        weights, self._weights = self._weights, None
        async for name, tensor in iter_named_tensors(weights):
            yield name, cast_for_rollout(tensor, self.rollout_dtype)

    def finalize(self) -> None:
        self._weights = None
