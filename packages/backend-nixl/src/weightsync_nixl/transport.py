"""NIXL as a :class:`~weightsync_core.net.transport.PeerTransport`: one agent per process."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import sys
import time
import uuid
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

import psutil
import torch

from weightsync_core.spi import (
    PeerTransport,
    RemoteBuffer,
    TransferError,
    WeightSyncError,
    describe_buffer,
)
from weightsync_nixl.options import DEFAULT_PROGRESS_DELAY_US

try:
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError as exc:  # the registry shows this message as the backend's load error
    raise ImportError(
        f"weightsync-nixl could not import NIXL ({exc}). Install the wheel for this host: "
        "pip install nixl (meta package; picks nixl-cu12 or nixl-cu13 by the CUDA it finds, "
        "and works on CPU-only hosts), or pin nixl-cu12 / nixl-cu13 explicitly"
    ) from exc

__all__ = ["NixlTransport", "interface_of", "ucx_net_devices"]

_MEMORY_TYPES = {"cpu": "DRAM", "cuda": "VRAM"}
_FIRST_POLL_SECONDS = 20e-6
_MAX_POLL_SECONDS = 2e-3
_RDMA_DEVICES = Path("/sys/class/infiniband")


def host_has_efa(devices: Path = _RDMA_DEVICES) -> bool:
    """Whether this host has an AWS EFA device (an RDMA device bound to the ``efa`` driver)."""
    drivers = devices.glob("*/device/driver") if devices.is_dir() else ()
    return any(driver.resolve().name == "efa" for driver in drivers)


def interface_of(host: str) -> str:
    """The network interface of this host that holds the address ``host``."""
    try:
        wanted = ipaddress.ip_address(host.strip("[]"))
    except ValueError as exc:
        raise WeightSyncError(
            f"NIXL needs this process's host as an IP address to pick its interface, got "
            f"{host!r}; set the engine's host (or WEIGHTSYNC_HOST) to an address"
        ) from exc
    interfaces = psutil.net_if_addrs()
    for name, addresses in interfaces.items():
        for address in addresses:
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(address.address.split("%", 1)[0]) == wanted:
                    return name
    held = ", ".join(f"{name} ({', '.join(a.address for a in addresses)})"
                     for name, addresses in interfaces.items())
    raise WeightSyncError(f"no network interface of this host holds {host}; it has: {held}")


def ucx_net_devices(host: str, devices: Path = _RDMA_DEVICES) -> str:
    """A ``UCX_NET_DEVICES`` value that leaves UCX's TCP transport the interface holding
    ``host`` alone (UCX listens on the address of every device it may use) and keeps every
    RDMA port (``mlx5_0:1``, ...), which the same variable would otherwise switch off."""
    rdma = sorted(f"{port.parent.parent.name}:{port.name}"
                  for port in (devices.glob("*/ports/*") if devices.is_dir() else ()))
    return ",".join([interface_of(host), *rdma])


def ucx_module_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """UCX settings to add to ``env`` (the caller's, over the process environment).

    The nixl wheels bundle their own libibverbs and libnl, but UCX's ``efa`` module links the
    host's ``libefa``, which pulls in the host's libibverbs and libnl too. With two libnl
    copies in the process, it crashes with SIGSEGV at exit (in ``rtnl_tc_unregister``) on any
    host with rdma-core's providers installed. On hosts without an EFA device that module has
    nothing to drive, so it is not loaded; an explicit ``UCX_MODULES`` always wins.
    """
    if "UCX_MODULES" in env or "UCX_MODULES" in os.environ or host_has_efa():
        return {}
    return {"UCX_MODULES": "^efa"}


def _native_agent(name: str, progress_delay_us: int) -> Any:
    """A native NIXL agent like the one :class:`nixl_agent` builds, but whose progress thread
    waits up to ``progress_delay_us`` for events between passes.

    ``nixl_agent`` always asks for a delay of 0, a progress thread that spins on one CPU
    core for the agent's whole life (see ``docs/backends/nixl.md``). The wrapper has no parameter
    for it, so its native agent, created with no backend yet, is replaced by this one before
    any backend starts.
    """
    if progress_delay_us < 0:
        raise ValueError(f"progress_delay_us must be >= 0, got {progress_delay_us}")
    bindings = sys.modules[nixl_agent.__module__].nixlBind
    config = bindings.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT.value
    config.pthrDelay = progress_delay_us
    config.lthrDelay = 100_000
    return bindings.nixlAgent(name, config)


class NixlTransport(PeerTransport):
    """One NIXL agent with one backend plugin, registering buckets and writing or reading
    peers' buckets.

    Args:
        plugin: the NIXL backend plugin (``"UCX"`` by default; ``"LIBFABRIC"``, ...).
        plugin_params: the plugin's init parameters (for UCX: ``ucx_devices``,
            ``num_workers``, ``ucx_error_handling_mode``), as strings.
        env: ``UCX_*`` (or other library) environment variables to set before the agent is
            created; UCX reads its settings from the environment once, at start-up. Unless
            ``UCX_MODULES`` is set here or in the environment, UCX's ``efa`` module is left
            out on hosts without an EFA device (see :func:`ucx_module_defaults`).
        num_threads: worker threads of multi-threaded plugins (0: the plugin's default).
        progress_delay_us: the longest the agent's progress thread waits for network
            events before its next pass, in microseconds. An event (a peer's write, an
            acknowledgement) wakes it at once, so throughput and latency stay those of
            polling; 0 makes it poll without pause, which keeps a whole CPU core busy for
            as long as the agent lives (the NIXL Python API's setting).
        host: this process's address on the cluster network. With the UCX plugin, UCX's
            TCP transport then listens on (and connects from) the interface holding it
            alone (see :func:`ucx_net_devices`), unless ``UCX_NET_DEVICES`` is set here or
            in the environment.

    A peer that registers new memory publishes new :meth:`metadata`; :meth:`connect` loads
    it into the known peer (NIXL adds the new registrations and keeps the connection).
    Removing and re-adding the peer instead would leave UCX's old TCP connection open on
    both sides (a socket leaked per reload) and fail transfers posted in between with
    ``NIXL_ERR_NOT_FOUND``.
    """

    def __init__(
        self,
        plugin: str = "UCX",
        plugin_params: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        num_threads: int = 0,
        host: str | None = None,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
    ) -> None:
        settings = {key: str(value) for key, value in (env or {}).items()}
        if host is not None and plugin == "UCX" and "UCX_NET_DEVICES" not in {
            *settings, *os.environ
        }:
            settings["UCX_NET_DEVICES"] = ucx_net_devices(host)
        os.environ.update({**ucx_module_defaults(settings), **settings})
        self.name = f"weightsync-{uuid.uuid4().hex[:12]}"
        # engines call the agent from several threads (forwards overlap): make it thread-safe
        config = nixl_agent_config(
            backends=[], num_threads=num_threads,
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = nixl_agent(self.name, config)
        self._agent.agent = _native_agent(self.name, progress_delay_us)
        available = self._agent.get_plugin_list()
        if plugin not in available:
            raise WeightSyncError(
                f"NIXL has no backend plugin {plugin!r} on this host; available: "
                f"{', '.join(sorted(available))}. Pass plugin=<one of them> in engine_kwargs."
            )
        params = {key: str(value) for key, value in (plugin_params or {}).items()}
        known = self._agent.get_plugin_params(plugin)
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise WeightSyncError(
                f"NIXL plugin {plugin} has no parameter(s) {', '.join(unknown)}; it accepts: "
                f"{', '.join(sorted(known)) or 'none'}"
            )
        self.plugin = plugin
        self._agent.create_backend(plugin, params)
        self._registered: dict[int, Any] = {}
        self._remote: dict[str, bytes] = {}

    def register(self, buffer: torch.Tensor) -> RemoteBuffer:
        descriptor = describe_buffer(buffer)
        self._registered[descriptor.addr] = self._agent.register_memory(
            [buffer], backends=[self.plugin]
        )
        return descriptor

    def deregister(self, buffer: torch.Tensor) -> None:
        descs = self._registered.pop(buffer.data_ptr(), None)
        if descs is not None:
            self._agent.deregister_memory(descs, backends=[self.plugin])

    def metadata(self) -> dict[str, Any]:
        return {"agent": self.name, "blob": self._agent.get_agent_metadata()}

    def connect(self, metadata: Any) -> Hashable:
        """Load a peer's metadata; for a known peer, its new registrations are added over
        the existing connection. The caller must not write to this peer meanwhile."""
        name, blob = metadata["agent"], metadata["blob"]
        if self._remote.get(name) == blob:
            return name
        try:
            self._agent.add_remote_agent(blob)
        except Exception:
            if name not in self._remote:
                raise
            # NIXL refused to merge (a known address re-registered with other keys): reload
            # the peer (this leaves UCX's old connection open; it does not happen on host
            # memory, where a re-registered address keeps its keys)
            self.disconnect(name)
            self._agent.add_remote_agent(blob)
        self._remote[name] = blob
        return name

    def disconnect(self, peer: Hashable) -> None:
        if self._remote.pop(str(peer), None) is not None:
            self._agent.remove_remote_agent(str(peer))

    def write(
        self, peer: Hashable, local: torch.Tensor, remote: RemoteBuffer, timeout: float
    ) -> None:
        self._transfer("WRITE", peer, local, remote, timeout)

    def read(
        self, peer: Hashable, local: torch.Tensor, remote: RemoteBuffer, timeout: float
    ) -> None:
        self._transfer("READ", peer, local, remote, timeout)

    def _transfer(
        self, operation: str, peer: Hashable, local: torch.Tensor, remote: RemoteBuffer,
        timeout: float,
    ) -> None:
        """Post one transfer and poll it (backing off to 2 ms) until done or ``timeout``."""
        nbytes = local.numel() * local.element_size()
        if nbytes != remote.nbytes:
            raise ValueError(f"local tensor has {nbytes} bytes, remote buffer {remote.nbytes}")
        if nbytes == 0:
            return
        local_descs = self._agent.get_xfer_descs([local])
        remote_descs = self._agent.get_xfer_descs(
            [(remote.addr, remote.nbytes, remote.device_id)], _MEMORY_TYPES[remote.device]
        )
        handle = self._agent.initialize_xfer(
            operation, local_descs, remote_descs, str(peer), backends=[self.plugin]
        )
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout
            pause = _FIRST_POLL_SECONDS
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(
                        f"NIXL {operation} of {nbytes} bytes still in progress after "
                        f"{timeout:.0f}s", code="PROC",
                    )
                time.sleep(pause)
                pause = min(pause * 2, _MAX_POLL_SECONDS)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(
                    f"NIXL {operation} of {nbytes} bytes ended in state {state} (the peer "
                    "died, deregistered its memory, or the network failed)", code=state,
                )
        finally:
            handle.release()

    def close(self) -> None:
        for name in list(self._remote):
            self.disconnect(name)
        for descs in self._registered.values():
            self._agent.deregister_memory(descs, backends=[self.plugin])
        self._registered.clear()
