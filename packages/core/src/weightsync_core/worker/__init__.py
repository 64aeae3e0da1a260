"""Layer 1, the per-process side of a sync: the rollout worker and the actor-side mixin that
own a process's engine. They run inside Ray actors but import no Ray, so a plain process can
drive an engine by hand."""

from weightsync_core.worker.owners import (
    ActorCheckpointEngineMixin,
    CheckpointEngineWorker,
    build_engine,
    built_settings,
    check_on_this_machine,
    close_engine,
)

__all__ = [
    "ActorCheckpointEngineMixin",
    "CheckpointEngineWorker",
    "build_engine",
    "built_settings",
    "check_on_this_machine",
    "close_engine",
]
