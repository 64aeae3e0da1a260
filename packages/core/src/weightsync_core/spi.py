"""The backend surface: the one module a weightsync backend imports.

Everything a transport package needs to build an engine is exported here under public
names: the engine interfaces, the typed handshake (``TypedEngine``, ``Handshake``) and the
two bases backends specialise (collective broadcast and
the pipelined ring) with their typed options, the base of sharded delivery by one-sided
writes, the peer-to-peer transport interface, bucket
packing and unpacking, delivery verification, the authenticated control channel, the
sealed rendezvous store (a group's store that only the sync's processes can use), the
blocking-call helper, bucket allocation on a device and the address helpers.

The bases' override points are public, documented methods (for instance
``CollectiveBroadcastCheckpointEngine.new_data_group`` or
``RingCheckpointEngine.create_transport``); a backend overrides those and nothing with a
leading underscore.

What this surface promises: a name exported here keeps its meaning and signature across
the minor releases of one major version of ``weightsync-core`` (while the major version is
0: across patch releases, and a minor release that changes it says so under "Backend
surface" in the CHANGELOG). A backend declares the lowest core release whose surface it
uses (``weightsync-core>=X.Y``). Any other ``weightsync_core`` module may change without
notice; ``tests/test_backend_surface.py`` checks that every first-party backend imports
nothing else.
"""

from weightsync_core.api.checksums import bucket_checksum, device_checksum
from weightsync_core.api.dtypes import parse_rollout_dtype
from weightsync_core.api.engine import (
    CheckpointEngine,
    CheckpointEngineWithCache,
    SyncProgress,
    TransferStats,
)
from weightsync_core.api.errors import (
    BackendLoadError,
    BackendNotInstalledError,
    EmptyWeightsError,
    EngineOptionsError,
    GroupInitTimeoutError,
    SenderAbortedError,
    TransferError,
    VerificationError,
    WeightSyncError,
)
from weightsync_core.api.handshake import Count, Handshake, Port, Text, from_wire, to_wire
from weightsync_core.api.hosts import check_bind_host, default_host
from weightsync_core.api.options import EngineOptions
from weightsync_core.api.registry import CheckpointEngineRegistry
from weightsync_core.data.bucketing import (
    BucketMeta,
    BucketPacker,
    BucketUnpacker,
    ReceiveBuffers,
    WeightsSource,
    copy_bytes,
    iter_named_tensors,
)
from weightsync_core.data.delta import (
    DeltaBaselineError,
    DeltaPlan,
    DeltaReceiver,
    DeltaSender,
    SpreadDeltaSender,
)
from weightsync_core.data.devices import allocate_bucket, resolve_device, synchronize_device
from weightsync_core.data.sync_layout import SyncLayout
from weightsync_core.data.verification import DeliveryVerifier, ManifestEntry
from weightsync_core.engines import (
    CollectiveBroadcastCheckpointEngine,
    CollectiveBroadcastOptions,
    RingCheckpointEngine,
    RingOptions,
    ShardedTransportEngine,
    ShardedTransportOptions,
    TypedEngine,
)
from weightsync_core.engines.broadcast import Collective
from weightsync_core.net.blocking import run_blocking
from weightsync_core.net.channel import ControlChannel, PeerEndpoints
from weightsync_core.net.process_group import RendezvousStore, create_store, rendezvous
from weightsync_core.net.transport import PeerTransport, RemoteBuffer, describe_buffer
from weightsync_core.net.wire import MessageSealer

__all__ = [
    "BackendLoadError",
    "BackendNotInstalledError",
    "BucketMeta",
    "BucketPacker",
    "BucketUnpacker",
    "CheckpointEngine",
    "CheckpointEngineRegistry",
    "CheckpointEngineWithCache",
    "Collective",
    "CollectiveBroadcastCheckpointEngine",
    "CollectiveBroadcastOptions",
    "ControlChannel",
    "Count",
    "DeliveryVerifier",
    "DeltaBaselineError",
    "DeltaPlan",
    "DeltaReceiver",
    "DeltaSender",
    "EmptyWeightsError",
    "EngineOptions",
    "EngineOptionsError",
    "GroupInitTimeoutError",
    "Handshake",
    "ManifestEntry",
    "MessageSealer",
    "PeerEndpoints",
    "PeerTransport",
    "Port",
    "ReceiveBuffers",
    "RemoteBuffer",
    "RendezvousStore",
    "RingCheckpointEngine",
    "RingOptions",
    "SenderAbortedError",
    "ShardedTransportEngine",
    "ShardedTransportOptions",
    "SpreadDeltaSender",
    "SyncLayout",
    "SyncProgress",
    "Text",
    "TransferError",
    "TransferStats",
    "TypedEngine",
    "VerificationError",
    "WeightSyncError",
    "WeightsSource",
    "allocate_bucket",
    "bucket_checksum",
    "check_bind_host",
    "copy_bytes",
    "create_store",
    "default_host",
    "describe_buffer",
    "device_checksum",
    "from_wire",
    "iter_named_tensors",
    "parse_rollout_dtype",
    "rendezvous",
    "resolve_device",
    "run_blocking",
    "synchronize_device",
    "to_wire",
]
