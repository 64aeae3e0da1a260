"""The ``gloo`` engine: collective broadcast over torch.distributed gloo on host memory."""

from __future__ import annotations

from weightsync_core.api.registry import CheckpointEngineRegistry
from weightsync_core.engines.broadcast import CollectiveBroadcastCheckpointEngine

__all__ = ["GlooCheckpointEngine"]


@CheckpointEngineRegistry.register("gloo")
class GlooCheckpointEngine(CollectiveBroadcastCheckpointEngine):
    """Portable CPU engine: buckets in host memory, one gloo group for control and data.

    Runs anywhere torch runs; use it where no faster interconnect exists, or as the
    reference the device backends are checked against.
    """

    device_type = "cpu"
