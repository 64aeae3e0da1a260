"""weightsync-core: checkpoint-engine interfaces, registry, bucketing and the sync manager.

The names follow verl's checkpoint engine (``CheckpointEngine``, ``CheckpointEngineRegistry``,
``CheckpointEngineManager``, ``CheckpointEngineWorker``; the training side is ``actor_wg``).

Three layers, as folders, each importable without the ones above it:

1. the engine layer, no Ray: :mod:`~weightsync_core.api` (the engine interface, config,
   options, registry, plugins, conversion), :mod:`~weightsync_core.net` (wire, channel,
   rendezvous store, process groups, peer transport), :mod:`~weightsync_core.data`
   (bucketing, verification, sync layouts, shards, delta), :mod:`~weightsync_core.engines`
   and :mod:`~weightsync_core.worker` (the per-process side), with
   :mod:`weightsync_core.spi`, the surface backends import;
2. :mod:`~weightsync_core.orchestration` on Ray: the manager, its stages and blame, the
   delta ledger, worker groups, deployments;
3. tools: :mod:`weightsync_core.plan`, :mod:`weightsync_core.bench`,
   :mod:`weightsync_core.testing`, the ``weightsync`` CLI.

Importing this package imports layer 1 only; the layer-2 names exported here
(``CheckpointEngineManager``, ``run_sync``, ``awaitable_or_blocking``, ``ensure_ray``,
``RayRolloutReplica``, ``RayWorkerGroup``, ``load_checkpoint_manager_class``) import Ray on
first use. The module paths before 0.18 (``weightsync_core.manager``, ...) still import,
with a ``DeprecationWarning`` (:mod:`weightsync_core._old_paths`).

Integrations and other packages import from this package's face, :mod:`weightsync_core.spi`
(backends), :mod:`weightsync_core.verl_compat` (engines written for verl),
:mod:`weightsync_core.data.shards` (sharded layouts), :mod:`weightsync_core.plan`,
:mod:`weightsync_core.bench` and its modules, and :mod:`weightsync_core.testing` (test
support).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from weightsync_core import _old_paths
from weightsync_core.api.config import ADAPTER_KEEP, CheckpointEngineConfig
from weightsync_core.api.conversion import ConversionError, convert
from weightsync_core.api.engine import (
    CheckpointEngine,
    CheckpointEngineWithCache,
    SyncProgress,
    TransferStats,
)
from weightsync_core.api.errors import (
    AdapterMismatchError,
    BackendLoadError,
    BackendNotFoundError,
    BackendNotInstalledError,
    BackendRegistrationError,
    EmptyWeightsError,
    EngineOptionsError,
    GroupInitTimeoutError,
    MalformedMessageError,
    ManifestChangedError,
    MetadataError,
    PluginError,
    SenderAbortedError,
    SyncStageError,
    SyncTimeoutError,
    TransferError,
    UnauthenticatedMessageError,
    VerificationError,
    WeightSyncError,
)
from weightsync_core.api.passes import passes_in
from weightsync_core.api.plugins import load_class, load_custom_backend_module
from weightsync_core.api.protocols import (
    CheckpointEngineWorkerGroup,
    PreparedSwitch,
    RolloutReplica,
    ServerAdapter,
)
from weightsync_core.api.registry import BackendInfo, BackendState, CheckpointEngineRegistry
from weightsync_core.api.session_key import new_session_key
from weightsync_core.data.adapters import AdapterSpec
from weightsync_core.data.bucketing import (
    BucketMeta,
    BucketPacker,
    BucketUnpacker,
    TensorMeta,
    WeightsSource,
)
from weightsync_core.worker import (
    ActorCheckpointEngineMixin,
    CheckpointEngineWorker,
    build_engine,
    close_engine,
    switch_paused,
)

_old_paths.install()

if TYPE_CHECKING:
    from weightsync_core.orchestration.local_ray import ensure_ray
    from weightsync_core.orchestration.manager import (
        CheckpointEngineManager,
        awaitable_or_blocking,
        run_sync,
    )
    from weightsync_core.orchestration.ray_group import (
        RayRolloutReplica,
        RayWorkerGroup,
        split_per_rank,
    )

_ORCHESTRATION = {
    "CheckpointEngineManager": "weightsync_core.orchestration.manager",
    "awaitable_or_blocking": "weightsync_core.orchestration.manager",
    "ensure_ray": "weightsync_core.orchestration.local_ray",
    "run_sync": "weightsync_core.orchestration.manager",
    "RayRolloutReplica": "weightsync_core.orchestration.ray_group",
    "RayWorkerGroup": "weightsync_core.orchestration.ray_group",
    "split_per_rank": "weightsync_core.orchestration.ray_group",
}
"""Layer-2 names exported here, imported (with Ray) on first use."""


def __getattr__(name: str) -> Any:
    if name in _ORCHESTRATION:
        import importlib

        value = getattr(importlib.import_module(_ORCHESTRATION[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'weightsync_core' has no attribute {name!r}")


try:
    __version__ = version("weightsync-core")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"


def load_checkpoint_manager_class(qualified_name: str | None) -> type[CheckpointEngineManager]:
    """The ``checkpoint_manager_class`` hook: load a :class:`CheckpointEngineManager` subclass
    by fully-qualified name (same safety policy as ``custom_backend_module``); ``None`` gives
    the default manager."""
    from weightsync_core.orchestration.manager import CheckpointEngineManager

    if qualified_name is None:
        return CheckpointEngineManager
    return load_class(qualified_name, CheckpointEngineManager)


__all__ = [
    "ADAPTER_KEEP",
    "ActorCheckpointEngineMixin",
    "AdapterMismatchError",
    "AdapterSpec",
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
    "ConversionError",
    "EmptyWeightsError",
    "EngineOptionsError",
    "GroupInitTimeoutError",
    "MalformedMessageError",
    "ManifestChangedError",
    "MetadataError",
    "PluginError",
    "PreparedSwitch",
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
    "WeightsSource",
    "__version__",
    "awaitable_or_blocking",
    "build_engine",
    "close_engine",
    "convert",
    "ensure_ray",
    "load_checkpoint_manager_class",
    "load_class",
    "load_custom_backend_module",
    "new_session_key",
    "passes_in",
    "run_sync",
    "split_per_rank",
    "switch_paused",
]
