"""The conformance suite, run for core's own engines."""

from weightsync_core.testing import (
    CheckpointEngineConformanceTests,
    ColocatedEngineConformanceTests,
)


class TestGlooConformance(CheckpointEngineConformanceTests):
    backend = "gloo"


class TestNaiveConformance(ColocatedEngineConformanceTests):
    backend = "naive"
