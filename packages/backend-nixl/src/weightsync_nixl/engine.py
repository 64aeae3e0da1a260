"""The ``nixl`` engine: core's pipelined ring with buckets moved by NIXL writes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightsync_core import CheckpointEngineRegistry
from weightsync_core.engines import RingCheckpointEngine
from weightsync_core.process_group import default_host
from weightsync_nixl.transport import NixlTransport

__all__ = ["NixlCheckpointEngine"]


@CheckpointEngineRegistry.register("nixl")
class NixlCheckpointEngine(RingCheckpointEngine):
    """Pipelined ring over NIXL: actor rank 0 writes each bucket into rollout worker 0's
    registered slot, which forwards it to rollout worker 1 while its server reads it, and so
    on. Bucket metadata and slot credits travel on core's ZeroMQ control channel.

    Args:
        bucket_size: bytes per bucket (two on the sender, ``slots`` on each receiver).
        device: ``"cpu"`` (host memory) or ``"cuda"`` (GPU memory; needs a CUDA build of
            torch and UCX with CUDA support, which the nixl-cu12/cu13 wheels include).
        plugin: NIXL backend plugin (``"UCX"``; ``"LIBFABRIC"`` on EFA, ...).
        plugin_params: extra init parameters of the plugin, e.g. ``{"num_workers": "2"}``.
        ucx_devices: the UCX plugin's ``ucx_devices`` parameter: which NICs UCX may use,
            e.g. ``"mlx5_0:1,mlx5_1:1"`` (default: all).
        ucx_transports: sets ``UCX_TLS`` before the agent starts, e.g. ``"rc,cuda_copy"``
            on InfiniBand/RoCE or ``"tcp"`` to force TCP (default: UCX chooses).
        ucx_env: further ``UCX_*`` variables to set before the agent starts, e.g.
            ``{"UCX_NET_DEVICES": "mlx5_0:1", "UCX_RNDV_THRESH": "8192"}``.
        num_threads: worker threads of the plugin (0: its default).
        **kwargs: see :class:`~weightsync_core.engines.RingCheckpointEngine` (``host``,
            ``slots``, ``keep_buffers``) and :class:`~weightsync_core.CheckpointEngine`.
    """

    def __init__(
        self,
        bucket_size: int,
        *,
        plugin: str = "UCX",
        plugin_params: Mapping[str, str] | None = None,
        ucx_devices: str | None = None,
        ucx_transports: str | None = None,
        ucx_env: Mapping[str, str] | None = None,
        num_threads: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(bucket_size, **kwargs)
        env = dict(ucx_env or {})
        bad = sorted(key for key in env if not key.startswith("UCX_"))
        if bad:
            raise ValueError(
                f"ucx_env keys must be UCX_* variables, got {', '.join(bad)}; pass other "
                "settings through plugin_params"
            )
        if ucx_transports is not None:
            env["UCX_TLS"] = ucx_transports
        params = dict(plugin_params or {})
        if ucx_devices is not None:
            if plugin != "UCX":
                raise ValueError(f"ucx_devices applies to the UCX plugin, not {plugin!r}")
            params["ucx_devices"] = ucx_devices
        self.plugin = plugin
        self.plugin_params = params
        self.env = env
        self.num_threads = num_threads

    def _create_transport(self) -> NixlTransport:
        return NixlTransport(self.plugin, self.plugin_params, self.env, self.num_threads,
                             self.host or default_host())
