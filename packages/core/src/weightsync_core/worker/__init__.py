"""Layer 1, the per-process side of a sync: the rollout worker
(:mod:`~weightsync_core.worker.rollout`), its staged updates
(:mod:`~weightsync_core.worker.staging`), the actor-side mixin
(:mod:`~weightsync_core.worker.actor`) and an engine's life in one process
(:mod:`~weightsync_core.worker.lifecycle`). They run inside Ray actors but import no Ray, so
a plain process can drive an engine by hand."""

from weightsync_core.worker.actor import ActorCheckpointEngineMixin
from weightsync_core.worker.lifecycle import (
    build_engine,
    built_settings,
    check_on_this_machine,
    close_engine,
)
from weightsync_core.worker.rollout import CheckpointEngineWorker
from weightsync_core.worker.staging import StagedWeights, switch_paused

__all__ = [
    "ActorCheckpointEngineMixin",
    "CheckpointEngineWorker",
    "StagedWeights",
    "build_engine",
    "built_settings",
    "check_on_this_machine",
    "close_engine",
    "switch_paused",
]
