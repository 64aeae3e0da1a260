"""Dedicated weight-sync process groups that never touch the default torch.distributed group.

A group rendezvous through a store only its members can use (served by rank 0,
:mod:`weightsync_core.sealed_store`) under a ``PrefixStore``, checks that every rank arrived
(naming the ones that did not), then builds the transport's process group from that store.
"""

from __future__ import annotations

import datetime
import errno
import os
import resource
import socket
import sys
import threading
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, ProcessGroupGloo, Store

from weightsync_core.errors import GroupInitTimeoutError
from weightsync_core.gloo_listener import (
    MAX_STRAY_CONNECTIONS,
    FormationGuard,
    find_new_listener,
    listening_sockets,
)
from weightsync_core.sealed_store import SealedStore, SealedStoreServer

__all__ = [
    "HOST_ENV",
    "RendezvousStore",
    "check_bind_host",
    "create_store",
    "default_host",
    "listen_on_free_port",
    "new_gloo_group",
    "raise_descriptor_limit",
    "rendezvous",
    "reserve_port",
]

HOST_ENV = "WEIGHTSYNC_HOST"
_DEVICE_CREATION = threading.Lock()


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


@dataclass
class RendezvousStore:
    """One rank's hold on a group's rendezvous store.

    Attributes:
        store: what torch's process groups take (the client, under the group's prefix).
        client: the rank's :class:`~weightsync_core.sealed_store.SealedStore` (kept here:
            torch calls back into it for as long as ``store`` is used).
        prefix: the group's prefix in the store.
        server: on group rank 0, the server it runs; None elsewhere.
    """

    store: Store
    client: SealedStore
    prefix: str
    server: SealedStoreServer | None = None

    def missing_after(self, keys: list[str], timeout: float) -> list[str]:
        """The group's ``keys`` not set within ``timeout`` seconds (one request: see
        :meth:`weightsync_core.sealed_store.SealedStore.missing_after`)."""
        missing = self.client.missing_after([f"{self.prefix}/{key}" for key in keys], timeout)
        return [key.removeprefix(f"{self.prefix}/") for key in missing]

    def close(self) -> None:
        """Stop the server, if this rank runs it (idempotent)."""
        if self.server is not None:
            self.server.close()


def create_store(
    host: str, port: int, rank: int, world_size: int, timeout: float, prefix: str,
    key: bytes, listener: socket.socket | None = None,
) -> RendezvousStore:
    """A rendezvous store served by rank 0 at ``host:port`` to the holders of ``key``
    (:mod:`weightsync_core.sealed_store`), under ``prefix``.

    Rank 0 passes ``listener`` (from :func:`listen_on_free_port`, on ``host:port``): its
    server takes that socket over, which listens on ``host`` only. ``world_size`` is only
    checked; :func:`rendezvous` waits for the ranks.

    Raises:
        ValueError: rank 0 without its listener, or a world size below 1.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of a group of {world_size}")
    server = None
    if rank == 0:
        if listener is None:
            raise ValueError("group rank 0 hosts the store: pass the listener from prepare()")
        server = SealedStoreServer(listener, key, timeout)
    client = SealedStore(host, port, key, timeout)
    return RendezvousStore(PrefixStore(prefix, client), client, prefix, server)


def rendezvous(store: RendezvousStore, rank: int, world_size: int, timeout: float) -> None:
    """Wait until all ``world_size`` ranks have checked in on ``store``.

    Raises:
        GroupInitTimeoutError: naming the ranks that never arrived (rank 0, when its store
            never answered).
    """
    keys = [f"arrived/{peer}" for peer in range(world_size)]
    try:
        store.store.set(keys[rank], "1")
        missing = store.missing_after(keys, timeout)
    except dist.DistStoreError as exc:
        raise GroupInitTimeoutError(
            f"rank {rank} could not use the weight-sync rendezvous store of rank 0 within "
            f"{timeout:.0f}s ({exc}); rank 0 never arrived or its address is not reachable "
            f"from this host (set {HOST_ENV} to a reachable address)",
            missing_ranks=[0],
        ) from exc
    if missing:
        ranks = [keys.index(key) for key in missing]
        raise GroupInitTimeoutError(
            f"weight-sync group of {world_size} ranks did not form within {timeout:.0f}s: "
            f"rank(s) {ranks} never arrived (seen from rank {rank})",
            missing_ranks=ranks,
        )


def new_gloo_group(
    store: Store, rank: int, world_size: int, timeout: float, host: str
) -> ProcessGroupGloo:
    """A gloo process group on ``store``, bound to ``host``; the default group is untouched.

    gloo's listener is open only while the group forms (:mod:`weightsync_core.gloo_listener`):
    once every pair is connected no one can connect to it, and a flood of connections
    while it forms closes it early, failing the group instead of the process.

    Raises:
        GroupInitTimeoutError: the group did not form within ``timeout``; naming the flood
            when stray connections closed the listener.
    """
    raise_descriptor_limit()
    with _DEVICE_CREATION:  # another group's device would be a second new listener
        before = listening_sockets()
        device = ProcessGroupGloo.create_device(hostname=host, lazy_init=False)
        listener = find_new_listener(before)
    # torch's stub omits ``_Options`` (the class the constructor takes) and that overload.
    options = ProcessGroupGloo._Options()  # pyright: ignore[reportAttributeAccessIssue]
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [device]
    with FormationGuard(listener, peers=world_size - 1) as guard:
        try:
            return ProcessGroupGloo(store, rank, world_size, options)
        except RuntimeError as exc:
            if not guard.flooded:
                raise
            raise GroupInitTimeoutError(
                f"rank {rank}'s gloo listener (port {guard.listener.port} of {host}) held more "
                f"than {MAX_STRAY_CONNECTIONS} connections that were not its group's while the "
                f"group of {world_size} formed, and was closed: a connection flood from "
                f"outside the sync; the group did not form ({exc})", missing_ranks=[],
            ) from exc


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard
