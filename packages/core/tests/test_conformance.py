"""The conformance suite, run for core's own engines."""

from weightsync_core.testing import (
    CheckpointEngineConformanceTests,
    ColocatedEngineConformanceTests,
)


class TestGlooConformance(CheckpointEngineConformanceTests):
    backend = "gloo"


class TestNaiveConformance(ColocatedEngineConformanceTests):
    backend = "naive"


class TestGlooRelayConformance(CheckpointEngineConformanceTests):
    """Both actor ranks send (rank 0 and a relay on its host), each to its share."""

    backend = "gloo"
    engine_kwargs = {"senders": 2}  # noqa: RUF012
