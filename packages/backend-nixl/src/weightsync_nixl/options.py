"""Typed options of the ``nixl`` engine (its ``engine_kwargs``)."""

from __future__ import annotations

import difflib
import functools
import importlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from weightsync_core.spi import EngineOptions, RingOptions, ShardedTransportOptions

__all__ = [
    "DEFAULT_PROGRESS_DELAY_US",
    "NixlAgentOptions",
    "NixlOptions",
    "NixlShardedOptions",
    "available_plugins",
]

DEFAULT_PROGRESS_DELAY_US = 1000
"""How long a NIXL agent's progress thread waits for network events between passes (µs)."""


def available_plugins() -> frozenset[str] | None:
    """The NIXL backend plugins this process's NIXL library offers (``UCX``, ``LIBFABRIC``,
    ``POSIX``, ...), or None where NIXL cannot be imported here (a driver without it: the
    plugin is then checked where the engine runs). Asked once per process, of an agent
    with no thread and no backend (it loads no plugin)."""
    return _plugins_offered()


@functools.cache
def _plugins_offered() -> frozenset[str] | None:
    try:
        importlib.import_module("nixl")
        bindings = importlib.import_module("nixl._bindings")
    except (ImportError, OSError):
        return None
    config = bindings.nixlAgentConfig()
    config.useProgThread = False
    config.useListenThread = False
    probe = bindings.nixlAgent(f"weightsync-plugins-{uuid.uuid4().hex[:12]}", config)
    return frozenset(probe.getAvailPlugins())


def _check_plugin(plugin: str) -> None:
    """Refuse a ``plugin`` this process's NIXL does not offer (where NIXL is here).

    Raises:
        ValueError: naming the option, the value, the plugins offered and the fix.
    """
    offered = available_plugins()
    if offered is None or plugin in offered:
        return
    by_case = {name.lower(): name for name in offered}
    close = ([by_case[plugin.lower()]] if plugin.lower() in by_case
             else difflib.get_close_matches(plugin, sorted(offered), n=1))
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"option 'plugin' must be a NIXL backend plugin of this host's NIXL, got "
        f"{plugin!r}.{hint} Plugins offered: {', '.join(sorted(offered)) or 'none'}; fix "
        "engine_kwargs['nixl']['plugin'] (default 'UCX')"
    )


@dataclass(frozen=True)
class NixlAgentOptions(EngineOptions):
    """How a process opens its NIXL agent (shared by ``nixl`` and ``nixl_sharded``).

    Attributes:
        plugin: NIXL backend plugin (``"UCX"``; ``"LIBFABRIC"`` on EFA, ...); where NIXL is
            importable when the options are built (the driver, each worker), it must be one
            of the plugins it offers (:func:`available_plugins`).
        plugin_params: extra init parameters of the plugin, e.g. ``{"num_workers": "2"}``.
        ucx_devices: the UCX plugin's ``ucx_devices`` parameter: which NICs UCX may use,
            e.g. ``"mlx5_0:1,mlx5_1:1"`` (default: all).
        ucx_transports: sets ``UCX_TLS`` before the agent starts, e.g. ``"rc,cuda_copy"``
            on InfiniBand/RoCE or ``"tcp"`` to force TCP (default: UCX chooses).
        ucx_env: further ``UCX_*`` variables to set before the agent starts, e.g.
            ``{"UCX_NET_DEVICES": "mlx5_0:1", "UCX_RNDV_THRESH": "8192"}``.
        num_threads: worker threads of the plugin (0: its default).
        progress_delay_us: the longest the agent's progress thread waits for network
            events between passes, in microseconds (events wake it at once). 0 polls
            without pause: a CPU core busy for the agent's whole life, for a few
            microseconds less latency per message.
    """

    plugin: str = "UCX"
    plugin_params: Mapping[str, str] = field(default_factory=dict)
    ucx_devices: str | None = None
    ucx_transports: str | None = None
    ucx_env: Mapping[str, str] = field(default_factory=dict)
    num_threads: int = 0
    progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_plugin(self.plugin)
        bad = sorted(key for key in self.ucx_env if not key.startswith("UCX_"))
        if bad:
            raise ValueError(
                f"option 'ucx_env' takes UCX_* variables only, got {', '.join(bad)}; pass "
                "other settings through plugin_params"
            )
        if self.ucx_devices is not None and self.plugin != "UCX":
            raise ValueError(f"option 'ucx_devices' applies to the UCX plugin, not {self.plugin!r}")
        if self.num_threads < 0:
            raise ValueError(f"option 'num_threads' must be >= 0, got {self.num_threads}")
        if self.progress_delay_us < 0:
            raise ValueError(
                f"option 'progress_delay_us' must be >= 0, got {self.progress_delay_us}"
            )

    def plugin_init_params(self) -> dict[str, str]:
        """The plugin's init parameters: ``plugin_params`` plus ``ucx_devices``."""
        params = dict(self.plugin_params)
        if self.ucx_devices is not None:
            params["ucx_devices"] = self.ucx_devices
        return params

    def environment(self) -> dict[str, str]:
        """The ``UCX_*`` variables to set before the agent starts."""
        env = dict(self.ucx_env)
        if self.ucx_transports is not None:
            env["UCX_TLS"] = self.ucx_transports
        return env


@dataclass(frozen=True)
class NixlOptions(RingOptions, NixlAgentOptions):
    """Options of the ``nixl`` engine: the ring's (``device``, ``host``, ``slots``,
    ``keep_buffers``, ``rebuild_group``) and the agent's (:class:`NixlAgentOptions`:
    ``plugin``, ``ucx_transports``, ...).

    ``device="cuda"`` needs a CUDA build of torch and UCX with CUDA support, which the
    nixl-cu12/cu13 wheels include.
    """


@dataclass(frozen=True)
class NixlShardedOptions(ShardedTransportOptions, NixlAgentOptions):
    """Options of the ``nixl_sharded`` engine: sharded delivery's (``device``, ``host``,
    ``chunk_megabytes``, ``group_init_timeout``) and the agent's
    (:class:`NixlAgentOptions`)."""
