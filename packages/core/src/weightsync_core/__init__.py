"""weightsync-core: checkpoint-engine interfaces, registry, bucketing and the sync manager.

The names follow verl's checkpoint engine (``CheckpointEngine``, ``CheckpointEngineRegistry``,
``CheckpointEngineManager``, ``CheckpointEngineWorker``; the training side is ``actor_wg``).
"""

from importlib.metadata import PackageNotFoundError, version

from weightsync_core.base import (
    CheckpointEngine,
    CheckpointEngineWithCache,
    SyncProgress,
    TransferStats,
)
from weightsync_core.bucketing import BucketMeta, BucketPacker, BucketUnpacker, TensorMeta
from weightsync_core.config import CheckpointEngineConfig
from weightsync_core.errors import (
    BackendLoadError,
    BackendNotFoundError,
    BackendNotInstalledError,
    BackendRegistrationError,
    EmptyWeightsError,
    GroupInitTimeoutError,
    MalformedMessageError,
    ManifestChangedError,
    PluginError,
    SenderAbortedError,
    SyncStageError,
    SyncTimeoutError,
    TransferError,
    UnauthenticatedMessageError,
    VerificationError,
    WeightSyncError,
)
from weightsync_core.manager import CheckpointEngineManager, run_sync
from weightsync_core.plugins import load_class, load_custom_backend_module
from weightsync_core.protocols import CheckpointEngineWorkerGroup, RolloutReplica, ServerAdapter
from weightsync_core.ray_group import RayRolloutReplica, RayWorkerGroup
from weightsync_core.registry import BackendInfo, BackendState, CheckpointEngineRegistry
from weightsync_core.worker import ActorCheckpointEngineMixin, CheckpointEngineWorker, build_engine

try:
    __version__ = version("weightsync-core")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"


def load_checkpoint_manager_class(qualified_name: str | None) -> type[CheckpointEngineManager]:
    """The ``checkpoint_manager_class`` hook: load a :class:`CheckpointEngineManager` subclass
    by fully-qualified name (same safety policy as ``custom_backend_module``); ``None`` gives
    the default manager."""
    if qualified_name is None:
        return CheckpointEngineManager
    return load_class(qualified_name, CheckpointEngineManager)


__all__ = [
    "ActorCheckpointEngineMixin",
    "BackendInfo",
    "BackendLoadError",
    "BackendNotFoundError",
    "BackendNotInstalledError",
    "BackendRegistrationError",
    "BackendState",
    "BucketMeta",
    "BucketPacker",
    "BucketUnpacker",
    "CheckpointEngine",
    "CheckpointEngineConfig",
    "CheckpointEngineManager",
    "CheckpointEngineRegistry",
    "CheckpointEngineWithCache",
    "CheckpointEngineWorker",
    "CheckpointEngineWorkerGroup",
    "EmptyWeightsError",
    "GroupInitTimeoutError",
    "MalformedMessageError",
    "ManifestChangedError",
    "PluginError",
    "RayRolloutReplica",
    "RayWorkerGroup",
    "RolloutReplica",
    "SenderAbortedError",
    "ServerAdapter",
    "SyncProgress",
    "SyncStageError",
    "SyncTimeoutError",
    "TensorMeta",
    "TransferError",
    "TransferStats",
    "UnauthenticatedMessageError",
    "VerificationError",
    "WeightSyncError",
    "__version__",
    "build_engine",
    "load_checkpoint_manager_class",
    "load_class",
    "load_custom_backend_module",
    "run_sync",
]
