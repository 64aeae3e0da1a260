"""weightsync-mooncake: the ``mooncake`` and ``mooncake_sharded`` checkpoint-engine backends (a
pipelined ring over Mooncake Transfer Engine; sharded delivery by Mooncake writes).

The registry loads it lazily through the ``weightsync.backends`` entry point; if the
Transfer Engine cannot load, ``weightsync backends`` shows the loader's error and the fix.
"""

from weightsync_mooncake.engine import MooncakeCheckpointEngine, MooncakeShardedCheckpointEngine
from weightsync_mooncake.transport import MooncakeTransport

__all__ = ["MooncakeCheckpointEngine", "MooncakeShardedCheckpointEngine", "MooncakeTransport"]
