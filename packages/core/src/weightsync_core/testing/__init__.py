"""Conformance suite and test harness for checkpoint-engine backends.

Subclass :class:`CheckpointEngineConformanceTests` (or
:class:`ColocatedEngineConformanceTests`) in your backend's tests and set ``backend``.
Requires pytest (``pip install weightsync-core[testing]``).
"""

from weightsync_core.testing.harness import SyncHarness, ensure_ray
from weightsync_core.testing.suite import (
    CheckpointEngineConformanceTests,
    ColocatedEngineConformanceTests,
)
from weightsync_core.testing.weights import Faults, digest, digests, make_weights

__all__ = [
    "CheckpointEngineConformanceTests",
    "ColocatedEngineConformanceTests",
    "Faults",
    "SyncHarness",
    "digest",
    "digests",
    "ensure_ray",
    "make_weights",
]
