"""The ``nixl`` engine (core's pipelined ring with buckets moved by NIXL writes) and the
``nixl_sharded`` engine (sharded delivery: every actor rank writes its slices by NIXL)."""

from __future__ import annotations

from weightsync_core.spi import (
    CheckpointEngineRegistry,
    RingCheckpointEngine,
    ShardedTransportEngine,
    default_host,
)
from weightsync_nixl.options import NixlAgentOptions, NixlOptions, NixlShardedOptions
from weightsync_nixl.transport import NixlTransport

__all__ = ["NixlCheckpointEngine", "NixlShardedCheckpointEngine", "open_agent"]


def open_agent(options: NixlAgentOptions, host: str | None) -> NixlTransport:
    """This process's NIXL agent as ``options`` describe it, on ``host`` (default: this
    process's address)."""
    return NixlTransport(options.plugin, options.plugin_init_params(), options.environment(),
                         options.num_threads, host or default_host(),
                         options.progress_delay_us)


@CheckpointEngineRegistry.register("nixl")
class NixlCheckpointEngine(RingCheckpointEngine):
    """Pipelined ring over NIXL: actor rank 0 writes each bucket into rollout worker 0's
    registered slot, which forwards it to rollout worker 1 while its server reads it, and so
    on. Bucket metadata and slot credits travel on core's ZeroMQ control channel.

    Options: :class:`~weightsync_nixl.options.NixlOptions` (``plugin``, ``ucx_transports``,
    ...), given as ``engine_kwargs={"nixl": {...}}``.
    """

    options_class = NixlOptions
    # options_class makes it a NixlOptions; core declares the base attribute mutable, so
    # narrowing it is reported although nothing assigns another type.
    options: NixlOptions  # pyright: ignore[reportIncompatibleVariableOverride]  # built from options_class

    def create_transport(self) -> NixlTransport:
        return open_agent(self.options, self.host)


@CheckpointEngineRegistry.register("nixl_sharded")
class NixlShardedCheckpointEngine(ShardedTransportEngine):
    """Sharded delivery over NIXL: every rollout worker receives only the slices its layout
    declares, written by the actor ranks that hold them, all at once (core's
    :class:`~weightsync_core.spi.ShardedTransportEngine`).

    Options: :class:`~weightsync_nixl.options.NixlShardedOptions`, given as
    ``engine_kwargs={"nixl_sharded": {...}}``.
    """

    options_class = NixlShardedOptions
    options: NixlShardedOptions  # pyright: ignore[reportIncompatibleVariableOverride]  # built from options_class

    def create_transport(self) -> NixlTransport:
        return open_agent(self.options, self.host)
