"""weightsync-nixl: the ``nixl`` checkpoint-engine backend (a pipelined ring over NIXL).

The registry loads it lazily through the ``weightsync.backends`` entry point; if NIXL cannot
be imported, ``weightsync backends`` shows the import error and which wheel to install.
"""

from weightsync_nixl.engine import NixlCheckpointEngine
from weightsync_nixl.transport import NixlTransport

__all__ = ["NixlCheckpointEngine", "NixlTransport"]
