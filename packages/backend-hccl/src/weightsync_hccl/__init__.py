"""weightsync-hccl: the ``hccl`` checkpoint-engine backend (collective broadcast on Ascend).

Importing this module imports ``torch_npu``; when it is missing, the registry shows that
import error and how to install it.
"""

from weightsync_hccl.engine import HCCLCheckpointEngine

__all__ = ["HCCLCheckpointEngine"]
