"""weightsync-mooncake: the ``mooncake`` checkpoint-engine backend (a pipelined ring over
Mooncake Transfer Engine).

The registry loads it lazily through the ``weightsync.backends`` entry point; if the
Transfer Engine cannot load, ``weightsync backends`` shows the loader's error and the fix.
"""

from weightsync_mooncake.engine import MooncakeCheckpointEngine
from weightsync_mooncake.transport import MooncakeTransport

__all__ = ["MooncakeCheckpointEngine", "MooncakeTransport"]
