"""The core conformance suite for ``nixl`` on host memory between real Ray actor processes."""

from weightsync_core import passes_in
from weightsync_core.testing import (
    AdapterSyncConformanceTests,
    CheckpointEngineConformanceTests,
    ConnectionStormTests,
    ControlFrameReplayTests,
    DeltaSyncConformanceTests,
    ShardedDeliveryConformanceTests,
)
from weightsync_core.testing.harness import SyncHarness


class TestNixlConformance(
    CheckpointEngineConformanceTests, ControlFrameReplayTests, DeltaSyncConformanceTests,
    AdapterSyncConformanceTests, ConnectionStormTests,
):
    """Actor rank 0 -> 1-worker replica -> 2-worker replica (3 rollout workers), over TCP."""

    backend = "nixl"
    engine_kwargs = {"device": "cpu", "ucx_transports": "tcp"}  # noqa: RUF012

    def test_each_bucket_is_copied_out_and_checked_in_one_pass(self, harness: SyncHarness):
        expected = harness.set_weights(seed=71)
        metrics = harness.manager().update_weights_sync(global_steps=71)
        self.assert_delivered(harness, expected)
        passes = set(passes_in(metrics))
        assert {"pack", "write", "copy_out_checksum"} <= passes
        # no second pass on the host: hashed while packed, and while copied out
        assert not passes & {"sender_checksum", "copy_out", "receiver_checksum"}


class TestNixlShardedConformance(CheckpointEngineConformanceTests,
                                 ShardedDeliveryConformanceTests, ConnectionStormTests):
    """Sharded delivery with every actor rank writing its slices by NIXL over TCP; small
    writes, so the embedding's pieces land in several."""

    backend = "nixl_sharded"
    engine_kwargs = {"ucx_transports": "tcp", "chunk_megabytes": 0.004}  # noqa: RUF012
    soak_syncs = 100  # a gloo group is built every sync: a leak per sync shows after 100
