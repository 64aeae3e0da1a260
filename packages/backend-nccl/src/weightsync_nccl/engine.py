"""The NCCL engine: core's collective-broadcast pipeline with buckets in CUDA memory."""

from __future__ import annotations

import datetime
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from weightsync_core.spi import (
    CheckpointEngineRegistry,
    Collective,
    CollectiveBroadcastCheckpointEngine,
)

__all__ = ["NCCLCheckpointEngine"]

if not dist.is_nccl_available():
    raise ImportError(
        f"this torch build ({torch.__version__}) has no NCCL support; the nccl backend needs a "
        "CUDA build of torch (pip install torch from the CUDA index)"
    )


@CheckpointEngineRegistry.register("nccl")
class NCCLCheckpointEngine(CollectiveBroadcastCheckpointEngine):
    """Broadcast buckets in CUDA memory over an NCCL communicator.

    The communicator is built on the engine's dedicated store (never the default process
    group) and reused across syncs unless ``rebuild_group=True``. Bucket copies run on the
    current CUDA stream and the broadcast on NCCL's own stream; the engine synchronises
    before a bucket is sent, reused or read. Bucket metadata travels on a small gloo group.

    Args:
        bucket_size: bytes per bucket (two on the sender, three on each receiver).
        **kwargs: see :class:`~weightsync_core.engines.CollectiveBroadcastCheckpointEngine`
            (``senders`` for relays on the sender's node, ``rebuild_group``,
            ``group_init_timeout``, ...).

    Raises:
        WeightSyncError: no CUDA device is visible to this process.
    """

    device_type = "cuda"

    def new_data_group(
        self, store: Store, rank: int, world_size: int, control: Collective
    ) -> Collective:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=self.timeout)
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        connect = getattr(group, "eager_connect_single_device", None)
        if connect is not None:  # form the communicator now, inside the init timeout
            connect(self.device)
        # Core types the data communicator as a ProcessGroup; a c10d backend such as
        # ProcessGroupNCCL offers the same broadcast (torch's Backend stub omits it).
        return cast(Collective, group)
