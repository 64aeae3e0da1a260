"""The ``mooncake`` engine: core's pipelined ring with buckets moved by Mooncake writes."""

from __future__ import annotations

from typing import Any

from weightsync_core import CheckpointEngineRegistry
from weightsync_core.engines import RingCheckpointEngine
from weightsync_core.process_group import default_host
from weightsync_mooncake.transport import MooncakeTransport

__all__ = ["MooncakeCheckpointEngine"]


@CheckpointEngineRegistry.register("mooncake")
class MooncakeCheckpointEngine(RingCheckpointEngine):
    """Pipelined ring over Mooncake Transfer Engine: actor rank 0 writes each bucket into
    rollout worker 0's registered slot, which forwards it while its server reads it, and so
    on. Peers connect by P2P handshake (no metadata server); bucket metadata and slot
    credits travel on core's ZeroMQ control channel, so no process spins while it waits.

    Unlike verl's Mooncake engine, a tensor larger than the bucket is split into chunks.

    Args:
        bucket_size: bytes per bucket (two on the sender, ``slots`` on each receiver).
        protocol: Transfer Engine protocol: ``"tcp"`` (default), ``"rdma"``, ``"efa"``,
            ``"ascend_direct"``, ...
        device_name: comma-separated RDMA device names (``"mlx5_0,mlx5_1"``); empty lets
            the engine discover them.
        **kwargs: see :class:`~weightsync_core.engines.RingCheckpointEngine` (``device``,
            ``host``, ``slots``, ``keep_buffers``) and :class:`~weightsync_core.CheckpointEngine`.
    """

    def __init__(
        self, bucket_size: int, *, protocol: str = "tcp", device_name: str = "", **kwargs: Any
    ) -> None:
        super().__init__(bucket_size, **kwargs)
        if not protocol or not isinstance(protocol, str):
            raise ValueError(f"protocol must be a Transfer Engine protocol name, got {protocol!r}")
        self.protocol = protocol
        self.device_name = device_name

    def _create_transport(self) -> MooncakeTransport:
        return MooncakeTransport(self.host or default_host(), self.protocol, self.device_name)
