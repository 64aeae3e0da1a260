"""Engines shipped with core: ``naive`` (colocated), ``gloo`` (collective broadcast), and the
bases device and peer-to-peer backends build on."""

from weightsync_core.engines.broadcast import CollectiveBroadcastCheckpointEngine
from weightsync_core.engines.gloo import GlooCheckpointEngine
from weightsync_core.engines.naive import ColocatedCheckpointEngine
from weightsync_core.engines.options import CollectiveBroadcastOptions, RingOptions
from weightsync_core.engines.ring import RingCheckpointEngine

__all__ = [
    "CollectiveBroadcastCheckpointEngine",
    "CollectiveBroadcastOptions",
    "ColocatedCheckpointEngine",
    "GlooCheckpointEngine",
    "RingCheckpointEngine",
    "RingOptions",
]
