"""Checkpoint-engine manager classes named by ``rollout.checkpoint_manager_class``."""

from weightsync_core import CheckpointEngineManager


class NoOpCheckpointEngineManager(CheckpointEngineManager):
    """Reports a sync but moves nothing: the rollout keeps serving its initial weights."""

    async def update_weights(self, global_steps=None):
        return {
            "weightsync/bytes": 0.0,
            "weightsync/seconds/total": 0.0,
            "weightsync/gbps": 0.0,
            "weightsync/transfer_gbps": 0.0,
        }


class RecordingCheckpointEngineManager(CheckpointEngineManager):
    """The default manager, remembering the ``global_steps`` of every sync."""

    def __init__(self, config, actor_wg, replicas=()):
        super().__init__(config, actor_wg, replicas)
        self.synced_steps = []

    async def update_weights(self, global_steps=None):
        metrics = await super().update_weights(global_steps)
        self.synced_steps.append(global_steps)
        return metrics


class NotAManager:
    """Has the right name shape but is no CheckpointEngineManager."""

    def __init__(self, config, actor_wg, replicas=()):
        self.config = config
