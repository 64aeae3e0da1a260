"""The HCCL engine: core's collective-broadcast pipeline with buckets in Ascend NPU memory."""

from __future__ import annotations

import datetime

import torch.distributed as dist

try:
    import torch_npu  # noqa: F401  (registers torch.npu and ProcessGroupHCCL)
except ImportError as exc:
    raise ImportError(
        "the hccl backend needs torch_npu (Ascend's PyTorch adapter), which is not "
        "importable here: install the torch-npu release that matches your torch and CANN "
        "versions (pip install torch-npu==<your torch version>), then retry"
    ) from exc

from weightsync_core.spi import (
    CheckpointEngineRegistry,
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
        self, store: dist.Store, rank: int, world_size: int, control: dist.ProcessGroup
    ) -> dist.ProcessGroup:
        return dist.ProcessGroupHCCL(
            store, rank, world_size, datetime.timedelta(seconds=self.timeout)
        )
