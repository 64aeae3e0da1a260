"""The ``mooncake`` engine: core's pipelined ring with buckets moved by Mooncake writes."""

from __future__ import annotations

from typing import Any

from weightsync_core.spi import (
    CheckpointEngineRegistry,
    RingCheckpointEngine,
    default_host,
)
from weightsync_mooncake.options import MooncakeOptions
from weightsync_mooncake.transport import MooncakeTransport

__all__ = ["MooncakeCheckpointEngine"]


@CheckpointEngineRegistry.register("mooncake")
class MooncakeCheckpointEngine(RingCheckpointEngine):
    """Pipelined ring over Mooncake Transfer Engine: actor rank 0 writes each bucket into
    rollout worker 0's registered slot, which forwards it while its server reads it, and so
    on. Peers connect by P2P handshake (no metadata server); bucket metadata and slot
    credits travel on core's ZeroMQ control channel, so no process spins while it waits.

    Unlike verl's Mooncake engine, a tensor larger than the bucket is split into chunks.

    Options: :class:`~weightsync_mooncake.options.MooncakeOptions` (``protocol``,
    ``device_name``, the ring's ``slots``, ...), given as ``engine_kwargs={"mooncake": {...}}``.
    """

    options_class = MooncakeOptions
    # options_class makes it a MooncakeOptions; core declares the base attribute mutable, so
    # narrowing it is reported although nothing assigns another type.
    options: MooncakeOptions  # pyright: ignore[reportIncompatibleVariableOverride]  # built from options_class

    def __init__(self, bucket_size: int, **kwargs: Any) -> None:
        super().__init__(bucket_size, **kwargs)
        self.protocol = self.options.protocol
        self.device_name = self.options.device_name

    def create_transport(self) -> MooncakeTransport:
        return MooncakeTransport(self.host or default_host(), self.protocol, self.device_name)
