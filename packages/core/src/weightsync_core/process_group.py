"""Dedicated weight-sync process groups that never touch the default torch.distributed group.

Each sync builds its own ``TCPStore`` (hosted by rank 0) wrapped in a ``PrefixStore``, checks
that every rank arrived (naming the ones that did not), then builds the transport's process
group from that store.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import sys
import time

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, ProcessGroupGloo, Store

from weightsync_core.errors import GroupInitTimeoutError

__all__ = [
    "HOST_ENV",
    "check_bind_host",
    "create_store",
    "default_host",
    "listen_on_free_port",
    "new_gloo_group",
    "rendezvous",
    "reserve_port",
]

HOST_ENV = "WEIGHTSYNC_HOST"


def default_host() -> str:
    """The address other processes use to reach this one.

    ``WEIGHTSYNC_HOST`` wins; inside Ray, the node's IP address; else ``127.0.0.1``.
    """
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    ray = sys.modules.get("ray")  # asked only where Ray runs: this layer never imports it
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound (not listening) to a free port of ``host``: while it stays open, no
    other bind takes that port. Close it right before binding the port for real."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock


def check_bind_host(host: str, setting: str | None = None) -> str:
    """``host``, if a weight-sync listener of this process can bind it: one address (never a
    wildcard such as ``0.0.0.0``) that belongs to this machine, checked by binding a
    throwaway socket to ``(host, 0)``. Call it in the process that will bind ``host`` (where
    the engine is built, where a listener is created), never on a driver that only checks a
    configuration: an address of a worker's machine is not one of the driver's.

    Args:
        host: the address to bind.
        setting: where ``host`` came from, for the error (e.g. ``"backend 'gloo': option
            'host' (engine_kwargs['gloo']['host'])"``); default: the engine's ``host``
            option or ``WEIGHTSYNC_HOST``.

    Raises:
        ValueError: naming the setting, the value, what is accepted and how to fix it.
    """
    given = setting or f"the weight-sync host (the engine's 'host' option, or {HOST_ENV})"
    fix = (
        f"set the engine's host option (engine_kwargs[<backend>]['host']) or {HOST_ENV} to "
        "this process's address on the cluster network, or leave both unset to use the Ray "
        "node's IP address"
    )
    if host in ("0.0.0.0", "::", "*", ""):
        raise ValueError(
            f"{given}: a weight-sync listener binds to one address of this machine, not "
            f"{host!r} (a wildcard: every interface); {fix}"
        )
    address = host.strip("[]")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError as exc:
        reason = ("no network interface of this machine holds that address (EADDRNOTAVAIL)"
                  if exc.errno == errno.EADDRNOTAVAIL else f"{type(exc).__name__}: {exc}")
        ray = sys.modules.get("ray")
        node = (f", or this Ray node's {ray.util.get_node_ip_address()}"
                if ray is not None and ray.is_initialized() else "")
        raise ValueError(
            f"{given} is {host!r}, which this machine ({socket.gethostname()}) cannot bind: "
            f"{reason}. Accepted: an address of one of this machine's network interfaces "
            f"(e.g. 127.0.0.1{node}); {fix}"
        ) from exc
    return host


def listen_on_free_port(host: str) -> socket.socket:
    """A socket listening on a free port of ``host`` (that address only, never a wildcard):
    hand it to :func:`create_store` as the store's listener."""
    sock = reserve_port(check_bind_host(host))
    try:
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def create_store(
    host: str, port: int, rank: int, world_size: int, timeout: float, prefix: str,
    listener: socket.socket | None = None,
) -> Store:
    """A ``TCPStore`` hosted by rank 0 at ``host:port``, under ``prefix``.

    Rank 0 passes ``listener`` (from :func:`listen_on_free_port`, on ``host:port``): its
    store serves that socket, which listens on ``host`` only (a store left to bind by
    itself listens on every interface). The store takes the socket over.

    Raises:
        GroupInitTimeoutError: a non-zero rank could not reach rank 0's store.
    """
    listen_fd: int | None = None
    if rank == 0:
        if listener is None:
            raise ValueError("group rank 0 hosts the store: pass the listener from prepare()")
        listen_fd = listener.detach()
    try:
        # torch.distributed re-exports TCPStore (public API) without `as` or `__all__`, so
        # pyright takes it for a private import.
        store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            host, port, world_size, rank == 0,
            timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
    except (RuntimeError, dist.DistStoreError) as exc:
        if rank == 0:
            raise GroupInitTimeoutError(
                f"rank 0 could not start the weight-sync store on {host}:{port} ({exc}); the "
                f"port may have been taken meanwhile, or {host} is not an address of this "
                f"host (set {HOST_ENV} to one)",
                missing_ranks=[],
            ) from exc
        raise GroupInitTimeoutError(
            f"rank {rank} could not reach the weight-sync store of rank 0 at {host}:{port} "
            f"within {timeout:.0f}s ({exc}); rank 0 never arrived or the address is not "
            f"reachable from this host (set {HOST_ENV} to a reachable address)",
            missing_ranks=[0],
        ) from exc
    return PrefixStore(prefix, store)


def rendezvous(store: Store, rank: int, world_size: int, timeout: float) -> None:
    """Wait until all ``world_size`` ranks have checked in on ``store``.

    Raises:
        GroupInitTimeoutError: naming the ranks that never arrived.
    """
    store.set(f"arrived/{rank}", "1")
    keys = [f"arrived/{peer}" for peer in range(world_size)]
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [peer for peer, key in enumerate(keys) if not store.check([key])]
            raise GroupInitTimeoutError(
                f"weight-sync group of {world_size} ranks did not form within {timeout:.0f}s: "
                f"rank(s) {missing} never arrived (seen from rank {rank})",
                missing_ranks=missing,
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def new_gloo_group(
    store: Store, rank: int, world_size: int, timeout: float, host: str
) -> ProcessGroupGloo:
    """A gloo process group on ``store``, bound to ``host``; the default group is untouched."""
    # torch's stub omits ``_Options`` (the class the constructor takes) and that overload.
    options = ProcessGroupGloo._Options()  # pyright: ignore[reportAttributeAccessIssue]
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    return ProcessGroupGloo(store, rank, world_size, options)
