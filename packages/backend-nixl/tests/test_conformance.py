"""The core conformance suite for ``nixl`` on host memory between real Ray actor processes."""

from weightsync_core.testing import (
    CheckpointEngineConformanceTests,
    ControlFrameReplayTests,
    DeltaSyncConformanceTests,
)


class TestNixlConformance(
    CheckpointEngineConformanceTests, ControlFrameReplayTests, DeltaSyncConformanceTests
):
    """Actor rank 0 -> 1-worker replica -> 2-worker replica (3 rollout workers), over TCP."""

    backend = "nixl"
    engine_kwargs = {"device": "cpu", "ucx_transports": "tcp"}  # noqa: RUF012
