"""The ``nixl`` engine: core's pipelined ring with buckets moved by NIXL writes."""

from __future__ import annotations

from typing import Any

from weightsync_core.spi import (
    CheckpointEngineRegistry,
    RingCheckpointEngine,
    default_host,
)
from weightsync_nixl.options import NixlOptions
from weightsync_nixl.transport import NixlTransport

__all__ = ["NixlCheckpointEngine"]


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

    def __init__(self, bucket_size: int, **kwargs: Any) -> None:
        super().__init__(bucket_size, **kwargs)
        self.plugin = self.options.plugin
        self.plugin_params = self.options.plugin_init_params()
        self.env = self.options.environment()
        self.num_threads = self.options.num_threads

    def create_transport(self) -> NixlTransport:
        return NixlTransport(self.plugin, self.plugin_params, self.env, self.num_threads,
                             self.host or default_host(), self.options.progress_delay_us)
