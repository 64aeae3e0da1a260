"""A third-party backend module living outside weightsync, reachable only via PYTHONPATH.

It registers ``acme_gloo`` (a gloo engine under another name) and ``acme_corrupting_gloo``,
whose receivers flip one byte of every bucket: verification must catch that.
"""

from weightsync_core import CheckpointEngineRegistry
from weightsync_core.engines import GlooCheckpointEngine


@CheckpointEngineRegistry.register("acme_gloo")
class AcmeGlooEngine(GlooCheckpointEngine):
    """Gloo under a custom name."""


@CheckpointEngineRegistry.register("acme_corrupting_gloo")
class CorruptingGlooEngine(GlooCheckpointEngine):
    """Flips the first byte of each received bucket (silent corruption on the wire)."""

    async def _receive_message(self, group, buffer):
        message, data = await super()._receive_message(group, buffer)
        if data.numel():
            data[0] ^= 0xFF
        return message, data
