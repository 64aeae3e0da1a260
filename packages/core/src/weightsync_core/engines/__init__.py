"""Engines shipped with core: ``naive`` (colocated), ``gloo`` (collective broadcast),
``gloo_sharded`` (sharded delivery point to point), and the bases device and peer-to-peer
backends build on (``ShardedTransportEngine``: sharded delivery by one-sided writes), and
``TypedEngine``, the typed handshake every one of them implements."""

from weightsync_core.engines.broadcast import CollectiveBroadcastCheckpointEngine
from weightsync_core.engines.gloo import GlooCheckpointEngine
from weightsync_core.engines.naive import ColocatedCheckpointEngine
from weightsync_core.engines.options import CollectiveBroadcastOptions, RingOptions
from weightsync_core.engines.ring import RingCheckpointEngine
from weightsync_core.engines.sharded_gloo import (
    ShardedGlooCheckpointEngine,
    ShardedGlooOptions,
)
from weightsync_core.engines.sharded_transport import (
    ShardedTransportEngine,
    ShardedTransportOptions,
)
from weightsync_core.engines.typed import TypedEngine

__all__ = [
    "CollectiveBroadcastCheckpointEngine",
    "CollectiveBroadcastOptions",
    "ColocatedCheckpointEngine",
    "GlooCheckpointEngine",
    "RingCheckpointEngine",
    "RingOptions",
    "ShardedGlooCheckpointEngine",
    "ShardedGlooOptions",
    "ShardedTransportEngine",
    "ShardedTransportOptions",
    "TypedEngine",
]
