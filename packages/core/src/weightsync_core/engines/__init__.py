"""Engines shipped with core: ``naive`` (colocated) and ``gloo`` (collective broadcast)."""

from weightsync_core.engines.broadcast import CollectiveBroadcastCheckpointEngine
from weightsync_core.engines.gloo import GlooCheckpointEngine
from weightsync_core.engines.naive import ColocatedCheckpointEngine

__all__ = [
    "CollectiveBroadcastCheckpointEngine",
    "ColocatedCheckpointEngine",
    "GlooCheckpointEngine",
]
