"""The HCCL engine: core's collective-broadcast pipeline with buckets in Ascend NPU memory."""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

try:
    # registers torch.npu and ProcessGroupHCCL; installed on Ascend hosts only
    import torch_npu  # noqa: F401  # pyright: ignore[reportMissingImports]
except ImportError as exc:
    raise ImportError(
        "the hccl backend needs torch_npu (Ascend's PyTorch adapter), which is not "
        "importable here: install the torch-npu release that matches your torch and CANN "
        "versions (pip install torch-npu==<your torch version>), then retry"
    ) from exc

from weightsync_core.spi import (
    CheckpointEngineRegistry,
    Collective,
    CollectiveBroadcastCheckpointEngine,
)

__all__ = ["HCCLCheckpointEngine"]


@CheckpointEngineRegistry.register("hccl")
class HCCLCheckpointEngine(CollectiveBroadcastCheckpointEngine):
    """Broadcast buckets in NPU memory over an HCCL communicator built on the engine's
    dedicated store; otherwise identical to the NCCL engine.

    Raises:
        WeightSyncError: no NPU is visible to this process.
    """

    device_type = "npu"

    def new_data_group(
        self, store: Store, rank: int, world_size: int, control: Collective
    ) -> Collective:
        # torch_npu adds ProcessGroupHCCL to torch.distributed at import; torch's stubs lack it
        return dist.ProcessGroupHCCL(  # pyright: ignore[reportAttributeAccessIssue]
            store, rank, world_size, datetime.timedelta(seconds=self.timeout)
        )
