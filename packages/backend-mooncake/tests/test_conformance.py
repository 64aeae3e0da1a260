"""The core conformance suite for ``mooncake`` over TCP between real Ray actor processes."""

from weightsync_core.testing import (
    AdapterSyncConformanceTests,
    CheckpointEngineConformanceTests,
    ConnectionStormTests,
    ControlFrameReplayTests,
    DeltaSyncConformanceTests,
    ShardedDeliveryConformanceTests,
)


class TestMooncakeConformance(
    CheckpointEngineConformanceTests, ControlFrameReplayTests, DeltaSyncConformanceTests,
    AdapterSyncConformanceTests, ConnectionStormTests,
):
    """Actor rank 0 -> 1-worker replica -> 2-worker replica (3 rollout workers), over TCP;
    includes a tensor 5x the bucket size (chunked, not refused)."""

    backend = "mooncake"
    engine_kwargs = {"protocol": "tcp"}  # noqa: RUF012


class TestMooncakeShardedConformance(CheckpointEngineConformanceTests,
                                     ShardedDeliveryConformanceTests, ConnectionStormTests):
    """Sharded delivery with every actor rank writing its slices by Mooncake over TCP; small
    writes, so the embedding's pieces land in several."""

    backend = "mooncake_sharded"
    engine_kwargs = {"protocol": "tcp", "chunk_megabytes": 0.004}  # noqa: RUF012
    soak_syncs = 100  # a gloo group is built every sync: a leak per sync shows after 100
