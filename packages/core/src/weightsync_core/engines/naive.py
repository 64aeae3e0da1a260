"""The ``naive`` engine: actor and rollout live in the same process, nothing is moved."""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from weightsync_core.api.engine import TransferStats
from weightsync_core.api.errors import WeightSyncError
from weightsync_core.api.handshake import Handshake
from weightsync_core.api.registry import CheckpointEngineRegistry
from weightsync_core.data.bucketing import WeightsSource, cast_for_rollout, iter_named_tensors
from weightsync_core.data.sync_layout import SyncLayout
from weightsync_core.engines.typed import TypedEngine

__all__ = ["ColocatedCheckpointEngine"]


@CheckpointEngineRegistry.register("naive")
class ColocatedCheckpointEngine(TypedEngine[Handshake, Handshake]):
    """Hands the actor's weight iterator straight to the colocated rollout server.

    ``send_weights`` stores the iterator; ``receive_weights`` (in the same process) iterates it,
    validating names and types and applying ``rollout_dtype``.
    """

    is_colocated = True
    family = "colocated sync"

    _weights: WeightsSource | None = None
    """The actor's weights, handed from ``send_weights`` to ``receive_weights``."""

    def announce(self) -> Handshake:
        """Nothing: there is no group to form."""
        return Handshake()

    @classmethod
    def plan(
        cls, layout: SyncLayout, metadata: list[Handshake]
    ) -> tuple[list[Handshake], list[Handshake]]:
        """Nothing for anyone."""
        return [Handshake()] * layout.actor_ranks, [Handshake()] * layout.rollout_world_size

    def join(self, arguments: Handshake) -> None:
        """Nothing to join."""

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
