"""Dedicated weight-sync process groups that never touch the default torch.distributed group.

A group rendezvous through a store only its members can use (served by rank 0,
:mod:`weightsync_core.net.sealed_store`) under a ``PrefixStore``, checks that every rank arrived
(naming the ones that did not), then builds the transport's process group from that store.
"""

from __future__ import annotations

import datetime
import resource
import socket
import threading
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, ProcessGroupGloo, Store

from weightsync_core.api.errors import GroupInitTimeoutError
from weightsync_core.api.hosts import HOST_ENV, check_bind_host
from weightsync_core.net.gloo_listener import (
    FormationGuard,
    find_new_listener,
    listening_sockets,
)
from weightsync_core.net.sealed_store import SealedStore, SealedStoreServer

__all__ = [
    "RendezvousStore",
    "create_store",
    "listen_on_free_port",
    "new_gloo_group",
    "raise_descriptor_limit",
    "rendezvous",
    "reserve_port",
]

_DEVICE_CREATION = threading.Lock()


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
        client: the rank's :class:`~weightsync_core.net.sealed_store.SealedStore` (kept here:
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
        :meth:`weightsync_core.net.sealed_store.SealedStore.missing_after`)."""
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
    (:mod:`weightsync_core.net.sealed_store`), under ``prefix``.

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

    gloo's listener is open only while the group forms (:mod:`weightsync_core.net.gloo_listener`):
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
                f"than {guard.limit} connections that were not its group's while the "
                f"group of {world_size} formed, and was closed: a connection flood from "
                f"outside the sync; the group did not form ({exc})", missing_ranks=[],
            ) from exc


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard
