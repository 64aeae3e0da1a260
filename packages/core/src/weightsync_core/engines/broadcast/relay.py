"""Relaying buckets packed elsewhere: kimi's replica leader pulls buckets peer-to-peer and
feeds them to its replica's broadcast group through this API."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import torch

from weightsync_core.api.errors import WeightSyncError
from weightsync_core.data.bucketing import BucketMeta
from weightsync_core.data.verification import Manifest
from weightsync_core.engines.broadcast.group import BroadcastGroup
from weightsync_core.engines.broadcast.protocol import (
    AbortMessage,
    BroadcastMessage,
    BucketMessage,
    FinalMessage,
    Posted,
)
from weightsync_core.net.blocking import run_blocking

__all__ = ["BroadcastRelay"]


class BroadcastRelay:
    """The relay API of :class:`~weightsync_core.engines.CollectiveBroadcastCheckpointEngine`
    (a mixin: it posts through the engine's group and wire protocol)."""

    # What the mixin uses of the engine, declared for the type checker only.
    timeout: float
    _healthy: bool

    if TYPE_CHECKING:

        def synchronize_device(self) -> None: ...

        def _require_group(self, *, sender: bool) -> BroadcastGroup | None: ...

        def _wait(self, group: BroadcastGroup, works: Posted) -> None: ...

        def _post_message(
            self, group: BroadcastGroup, message: BroadcastMessage,
            data: torch.Tensor | None = None,
        ) -> Posted: ...

    async def relay_bucket(self, meta: BucketMeta, data: torch.Tensor) -> None:
        """Group rank 0: broadcast one already-packed bucket (``data`` = its used bytes, on
        this engine's device); returns once it has left. Receivers run
        :meth:`receive_weights` as usual."""
        await self._relay(BucketMessage(meta), data)

    async def relay_final(self, manifest: Manifest, global_steps: int | None) -> None:
        """Group rank 0: end a relayed stream with the sender's manifest."""
        await self._relay(FinalMessage(list(manifest), global_steps))

    async def relay_abort(self, reason: str) -> None:
        """Group rank 0: tell the receivers the relayed stream is off (best effort)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._relay(AbortMessage(reason)), min(self.timeout, 30.0))

    async def _relay(self, message: BroadcastMessage, data: torch.Tensor | None = None) -> None:
        group = self._require_group(sender=True)
        if group is None:
            raise WeightSyncError(f"{type(self).__name__}: this rank has no group to relay to")
        try:
            if data is not None:
                self.synchronize_device()
            await run_blocking(self._wait, group, self._post_message(group, message, data))
        except BaseException:
            self._healthy = False
            raise
