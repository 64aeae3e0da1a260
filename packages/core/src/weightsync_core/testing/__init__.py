"""Conformance suite and test harness for checkpoint-engine backends.

Subclass :class:`CheckpointEngineConformanceTests` (or
:class:`ColocatedEngineConformanceTests`) in your backend's tests and set ``backend``.
The suite needs pytest (``pip install "weightsync-core[testing]"``); the harness and test
weights do not. Test support only: no production module imports this package (the benchmarks
use :mod:`weightsync_core.orchestration.deployment` and :mod:`weightsync_core.bench`).
"""

from typing import TYPE_CHECKING, Any

from weightsync_core.testing.harness import Placement, SyncHarness, ensure_ray
from weightsync_core.testing.ray_cluster import user_ray_cluster
from weightsync_core.testing.weights import Faults, digest, digests, make_weights

_SUITE = ("CheckpointEngineConformanceTests", "ColocatedEngineConformanceTests",
          "ControlFrameReplayTests")
_DELTA_SUITE = ("DeltaSyncConformanceTests",)
_SHARDED_SUITE = ("ShardedDeliveryConformanceTests",)
_STORM_SUITE = ("ConnectionStormTests",)
_ADAPTER_SUITE = ("AdapterSyncConformanceTests",)

if TYPE_CHECKING:  # at run time, __getattr__ imports them (and pytest) when asked for
    from weightsync_core.testing.adapter_suite import AdapterSyncConformanceTests
    from weightsync_core.testing.delta_suite import DeltaSyncConformanceTests
    from weightsync_core.testing.sharded_suite import ShardedDeliveryConformanceTests
    from weightsync_core.testing.storm_suite import ConnectionStormTests
    from weightsync_core.testing.suite import (
        CheckpointEngineConformanceTests,
        ColocatedEngineConformanceTests,
        ControlFrameReplayTests,
    )

__all__ = [
    "AdapterSyncConformanceTests", "CheckpointEngineConformanceTests",
    "ColocatedEngineConformanceTests", "ConnectionStormTests", "ControlFrameReplayTests",
    "DeltaSyncConformanceTests", "Faults",
    "Placement", "ShardedDeliveryConformanceTests", "SyncHarness", "digest", "digests",
    "ensure_ray", "make_weights", "user_ray_cluster",
]


def __getattr__(name: str) -> Any:
    """Import the pytest-based suite only when it is asked for."""
    if name in _SUITE:
        from weightsync_core.testing import suite

        return getattr(suite, name)
    if name in _DELTA_SUITE:
        from weightsync_core.testing import delta_suite

        return getattr(delta_suite, name)
    if name in _SHARDED_SUITE:
        from weightsync_core.testing import sharded_suite

        return getattr(sharded_suite, name)
    if name in _ADAPTER_SUITE:
        from weightsync_core.testing import adapter_suite

        return getattr(adapter_suite, name)
    if name in _STORM_SUITE:
        from weightsync_core.testing import storm_suite

        return getattr(storm_suite, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
