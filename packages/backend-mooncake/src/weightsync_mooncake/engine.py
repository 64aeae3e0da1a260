"""The ``mooncake`` engine (core's pipelined ring with buckets moved by Mooncake writes) and
the ``mooncake_sharded`` engine (sharded delivery: every actor rank writes its slices by
Mooncake)."""

from __future__ import annotations

from typing import Any

from weightsync_core.spi import (
    CheckpointEngineRegistry,
    RingCheckpointEngine,
    ShardedTransportEngine,
    default_host,
)
from weightsync_mooncake.options import MooncakeOptions, MooncakeShardedOptions
from weightsync_mooncake.transport import MooncakeTransport

__all__ = ["MooncakeCheckpointEngine", "MooncakeShardedCheckpointEngine"]


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


@CheckpointEngineRegistry.register("mooncake_sharded")
class MooncakeShardedCheckpointEngine(ShardedTransportEngine):
    """Sharded delivery over Mooncake Transfer Engine: every rollout worker receives only
    the slices its layout declares, written by the actor ranks that hold them, all at once
    (core's :class:`~weightsync_core.spi.ShardedTransportEngine`).

    Options: :class:`~weightsync_mooncake.options.MooncakeShardedOptions`, given as
    ``engine_kwargs={"mooncake_sharded": {...}}``.
    """

    options_class = MooncakeShardedOptions
    options: MooncakeShardedOptions  # pyright: ignore[reportIncompatibleVariableOverride]  # built from options_class

    def create_transport(self) -> MooncakeTransport:
        return MooncakeTransport(self.host or default_host(), self.options.protocol,
                                 self.options.device_name)
