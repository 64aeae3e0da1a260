"""Received weights into an inference server: counted, checked against the previous sync's
manifest before the server sees each tensor, and the server held to consuming them all."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import torch

from weightsync_core.api.engine import SyncProgress, TransferStats
from weightsync_core.api.errors import WeightSyncError
from weightsync_core.api.passes import PassTimes
from weightsync_core.api.protocols import ServerAdapter
from weightsync_core.data.verification import ManifestGuard

__all__ = ["deliver_weights"]


async def deliver_weights(
    adapter: ServerAdapter | None,
    weights: AsyncIterator[tuple[str, torch.Tensor]],
    global_steps: int | None,
    guard: ManifestGuard,
    progress: SyncProgress,
    passes: PassTimes | None = None,
) -> TransferStats:
    """Feed received weights to ``adapter`` while counting them and checking each against
    the previous sync's (``guard``: a changed tensor is refused before the server sees it;
    an empty stream fails); check the adapter consumed them all. The stream becomes the
    guard's reference only when the adapter returned without error. The time the adapter
    spends on the tensors it is handed is the ``load`` pass of ``passes``, if given."""
    if adapter is None:
        raise WeightSyncError(
            "this worker has no server adapter to load weights into; pass server_adapter= or "
            "set self.server_adapter before the first sync"
        )
    stats = TransferStats()
    exhausted = False

    async def counted() -> AsyncIterator[tuple[str, torch.Tensor]]:
        nonlocal exhausted
        progress.enter("receiving")
        async for name, tensor in weights:
            guard.check(name, tensor)
            stats.num_tensors += 1
            stats.nbytes += tensor.numel() * tensor.element_size()
            progress.enter("loading")
            handed = time.perf_counter()
            yield name, tensor
            if passes is not None:
                passes.add("load", time.perf_counter() - handed)
            progress.tensors += 1
            progress.enter("receiving")
        guard.finish()
        exhausted = True

    loop = asyncio.get_running_loop()
    start = loop.time()
    progress.tensors = 0
    try:
        await adapter.update_weights(counted(), global_steps=global_steps)
    finally:
        progress.enter("idle")
    if not exhausted:
        raise WeightSyncError(
            f"{type(adapter).__name__}.update_weights returned after {stats.num_tensors} "
            "tensors without consuming the whole stream; it must iterate every weight"
        )
    guard.accept()
    stats.seconds = loop.time() - start
    return stats
