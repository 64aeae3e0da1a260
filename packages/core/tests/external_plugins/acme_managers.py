"""Manager classes named by fully-qualified name in configuration."""

from weightsync_core import CheckpointEngineManager


class CountingManager(CheckpointEngineManager):
    """Counts syncs; otherwise the default manager."""

    syncs = 0

    async def update_weights(self, global_steps=None):
        type(self).syncs += 1
        return await super().update_weights(global_steps)


class NotAManager:
    """Does not subclass CheckpointEngineManager."""
