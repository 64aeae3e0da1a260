"""Typed options of the ``mooncake`` engine (its ``engine_kwargs``)."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync_core.spi import EngineOptions, RingOptions, ShardedTransportOptions

__all__ = ["MooncakeOptions", "MooncakeShardedOptions", "TransferEngineOptions"]


@dataclass(frozen=True)
class TransferEngineOptions(EngineOptions):
    """How a process opens Mooncake Transfer Engine (shared by ``mooncake``,
    ``mooncake_sharded`` and ``kimi``).

    Attributes:
        protocol: Transfer Engine protocol: ``"tcp"`` (default), ``"rdma"``, ``"efa"``,
            ``"ascend_direct"``, ...
        device_name: comma-separated RDMA device names (``"mlx5_0,mlx5_1"``); empty lets
            the engine discover them.
    """

    protocol: str = "tcp"
    device_name: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.protocol:
            raise ValueError("option 'protocol' must name a Transfer Engine protocol, got ''")


@dataclass(frozen=True)
class MooncakeOptions(RingOptions, TransferEngineOptions):
    """Options of the ``mooncake`` engine: the ring's (``device``, ``host``, ``slots``,
    ``keep_buffers``, ``rebuild_group``) and Transfer Engine's (``protocol``,
    ``device_name``)."""


@dataclass(frozen=True)
class MooncakeShardedOptions(ShardedTransportOptions, TransferEngineOptions):
    """Options of the ``mooncake_sharded`` engine: sharded delivery's (``device``, ``host``,
    ``chunk_megabytes``, ``group_init_timeout``) and Transfer Engine's (``protocol``,
    ``device_name``)."""
