"""weightsync-nccl: the ``nccl`` checkpoint-engine backend (collective broadcast on CUDA).

Importing this module needs a torch build with NCCL; the registry loads it lazily through
the ``weightsync.backends`` entry point and shows the import error if NCCL is missing.
"""

from weightsync_nccl.engine import NCCLCheckpointEngine

__all__ = ["NCCLCheckpointEngine"]
