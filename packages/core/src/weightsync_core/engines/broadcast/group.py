"""The broadcast group's lifecycle: the port reserved in ``prepare``, the rendezvous that
builds the communicators, their reuse by a later sync with the same members, and teardown.

The group's rendezvous store listens on the configured host only and answers only requests
sealed under the sync's key (:mod:`weightsync_core.net.sealed_store`): a process outside the sync
can neither list nor read the members' addresses, nor write a key or claim a rank, during
the sync or while the group is kept for later ones.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch.distributed.distributed_c10d import BroadcastOptions, PrefixStore, Store, Work

from weightsync_core.api.errors import WeightSyncError
from weightsync_core.data.topology import GroupKey, MasterAddress
from weightsync_core.net.process_group import (
    RendezvousStore,
    create_store,
    listen_on_free_port,
    new_gloo_group,
    rendezvous,
)
from weightsync_core.net.wire import MessageSealer

__all__ = ["BroadcastGroup", "Collective", "GroupLifecycle", "NewDataGroup"]


class Collective(Protocol):
    """What the engine calls on a communicator: a c10d backend (``ProcessGroupGloo``,
    ``ProcessGroupNCCL``, ...) or a ``ProcessGroup``. torch's stub of ``Backend`` omits its
    collectives, so a backend object is cast to this type where it is built."""

    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions, /) -> Work:
        """Enqueue a broadcast of ``tensors`` from ``opts.rootRank``."""
        ...


NewDataGroup = Callable[[Store, int, int, Collective], Collective]
"""Builds the communicator for bucket bytes: ``(store, rank, world_size, control group)``."""


@dataclass(frozen=True)
class BroadcastGroup:
    """One sync's communicators, captured by every transfer so that a thread left over from
    an aborted sync can never post into the next sync's group."""

    control: Collective
    data: Collective
    store: RendezvousStore
    sender: str
    sealer: MessageSealer
    """Seals and opens this sync's metadata (the group may outlive a sync; the key not)."""


class GroupLifecycle:
    """The group of one engine, across syncs.

    Args:
        engine_name: names the engine in errors.
        group_name: prefix of the engine's keys in the rendezvous store.
        init_timeout: seconds set-up may take before failing with the ranks that never
            arrived.
    """

    def __init__(self, engine_name: str, group_name: str, init_timeout: float) -> None:
        self.engine_name = engine_name
        self.group_name = group_name
        self.init_timeout = init_timeout
        self.group: BroadcastGroup | None = None
        self.key: GroupKey | None = None
        """What identifies the group held (its port and members), offered for reuse."""
        self._listener: socket.socket | None = None

    def reserve_port(self, host: str) -> int:
        """Listen on a free port of ``host`` from now on (closing any earlier reservation):
        if this process becomes group rank 0, its store serves this very socket (no other
        process can take the port meanwhile)."""
        self.close_listener()
        self._listener = listen_on_free_port(host)
        return self._listener.getsockname()[1]

    def close_listener(self) -> None:
        """Give up the reserved port, if any."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def reuse(
        self, rank: int, master_metadata: MasterAddress, members: tuple[str, ...] | None,
        sealer: MessageSealer,
    ) -> None:
        """Keep the held group for this sync (with its key); it must be the one asked for."""
        self.close_listener()
        if self.group is None or self.key != GroupKey(
            port=master_metadata.port, members=members or ()
        ):
            raise WeightSyncError(
                f"{self.engine_name}: asked to reuse a group this process does not hold "
                f"(rank {rank}); the topology and the engine state disagree"
            )
        self.group = dataclasses.replace(self.group, sealer=sealer)

    def build(
        self, rank: int, world_size: int, master_metadata: MasterAddress,
        members: tuple[str, ...] | None, sealer: MessageSealer, *, host: str, timeout: float,
        new_data_group: NewDataGroup,
    ) -> None:
        """Rendezvous with the other ranks and build the communicators (group rank 0
        serves the store on the port it reserved; every other rank gives its port up)."""
        listener, self._listener = self._listener, None
        if rank != 0 and listener is not None:
            listener.close()
            listener = None
        rendezvous_store = create_store(
            master_metadata.host, master_metadata.port, rank, world_size,
            self.init_timeout, self.group_name, sealer.derive_key("rendezvous store"),
            listener=listener,
        )
        try:
            rendezvous(rendezvous_store, rank, world_size, self.init_timeout)
            store = rendezvous_store.store
            control = cast(Collective, new_gloo_group(
                PrefixStore("control", store), rank, world_size, timeout, host
            ))
            data = new_data_group(PrefixStore("data", store), rank, world_size, control)
        except BaseException:
            rendezvous_store.close()
            raise
        sender = f"actor rank {master_metadata.sender}"
        self.group = BroadcastGroup(control, data, rendezvous_store, sender, sealer)
        self.key = GroupKey(port=master_metadata.port, members=members or ())

    def destroy(self) -> None:
        """Drop the group."""
        group, self.group = self.group, None
        self.key = None
        if group is not None:
            group.store.close()
        # Dropping the communicators last: their destructors may wait for transfers still in
        # flight after a failure, and by then the engine's state is already clean.
        del group
