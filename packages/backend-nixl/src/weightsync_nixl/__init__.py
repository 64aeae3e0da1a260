"""weightsync-nixl: the ``nixl`` and ``nixl_sharded`` checkpoint-engine backends (a pipelined
ring over NIXL; sharded delivery by NIXL writes).

The registry loads it lazily through the ``weightsync.backends`` entry point; if NIXL cannot
be imported, ``weightsync backends`` shows the import error and which wheel to install.
"""

from weightsync_nixl.engine import NixlCheckpointEngine, NixlShardedCheckpointEngine
from weightsync_nixl.transport import NixlTransport

__all__ = ["NixlCheckpointEngine", "NixlShardedCheckpointEngine", "NixlTransport"]
