"""Topologies, typed: what each process of a broadcast or ring sync announces, and the place
it gets.

Broadcast (``gloo``, ``nccl``, ``hccl``):
With one sender, actor rank 0 broadcasts to every rollout worker. With ``senders > 1``,
actor ranks on the same host as actor rank 0 join as relays: each sender (rank 0 and its
relays) broadcasts the weights it holds itself to its own, disjoint share of the rollout
workers, widening the fan-out. Relays pack their own weight stream, so they never wait on
another sender.

A group formed in an earlier sync is reused when every member reports it intact and the
membership is unchanged; otherwise the group is built anew on a fresh port.

Ring (``nixl``, ``mooncake``): actor rank 0 feeds rollout worker 0, which forwards each
bucket to rollout worker 1 while its own server reads it, and so on down the ring.

The planners take every process's announcement, already checked
(:class:`~weightsync_core.engines.typed.TypedEngine` decodes them, naming a process whose
``prepare()`` returned something else), and a
:class:`~weightsync_core.data.sync_layout.SyncLayout`; they return each rank's arguments.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from weightsync_core.api.handshake import Count, Handshake, Port, Text
from weightsync_core.data.sync_layout import SyncLayout

__all__ = [
    "EVERY_LOCAL_ACTOR_RANK",
    "BroadcastArguments",
    "BroadcastMetadata",
    "GroupKey",
    "MasterAddress",
    "RingMetadata",
    "RingPlacement",
    "SenderShare",
    "plan_broadcast",
    "plan_ring",
    "plan_sender_shares",
]


class GroupKey(Handshake, frozen=True, kw_only=True):
    """What identifies a broadcast group a process holds from an earlier sync.

    Attributes:
        port: the port its rendezvous store was served on.
        members: every member's id, group rank 0 first.
    """

    port: Port
    members: tuple[str, ...]


class BroadcastMetadata(Handshake, frozen=True, kw_only=True):
    """What a process of a broadcast sync announces.

    Attributes:
        host: where it is reached.
        port: the port it reserved (served if it becomes a group's rank 0).
        member: its unique id.
        group: the intact group it holds, if any (offered for reuse).
        senders: on actor ranks, the most senders the engine may use.
    """

    host: Text
    port: Port
    member: Text
    group: GroupKey | None = None
    senders: Count = 1


class MasterAddress(Handshake, frozen=True, kw_only=True):
    """Where a broadcast group meets.

    Attributes:
        host: group rank 0's address.
        port: the port of its rendezvous store.
        reuse: every member keeps the group it holds (nothing is built).
        sender: the actor rank that sends to the group.
    """

    host: Text
    port: Port
    reuse: bool = False
    sender: int = 0


class BroadcastArguments(Handshake, frozen=True, kw_only=True):
    """One rank's place in a broadcast sync (what ``init_process_group`` takes).

    Attributes:
        rank: its group rank (0: the sender), or -1 for an actor rank that only drains.
        world_size: its group's size (0 where it has no group).
        master_metadata: where its group meets (None where it has no group).
        members: its group's member ids, group rank 0 first.
    """

    rank: int
    world_size: int
    master_metadata: MasterAddress | None = None
    members: tuple[str, ...] | None = None


class RingMetadata(Handshake, frozen=True, kw_only=True):
    """What a process of a ring sync announces.

    Attributes:
        endpoint: its control channel's address.
    """

    endpoint: Text


class RingPlacement(Handshake, frozen=True, kw_only=True):
    """A process's place in one sync's ring (what ``init_process_group`` takes).

    Attributes:
        position: 0 for actor rank 0, ``i + 1`` for rollout worker ``i``, -1 for an actor
            rank that only drains its weights.
        sync_id: the sync, equal in every place of it.
        upstream: the control endpoint of the process before it (None at the head).
        upstream_name: that process's name (``"actor rank 0"``).
        downstream: the control endpoint of the process after it (None at the tail).
        downstream_name: that process's name.
    """

    position: int
    sync_id: Text
    upstream: str | None = None
    upstream_name: str | None = None
    downstream: str | None = None
    downstream_name: str | None = None


@dataclass(frozen=True)
class SenderShare:
    """One sender and the rollout workers it serves (indices into each side's ranks)."""

    sender: int
    receivers: tuple[int, ...]


EVERY_LOCAL_ACTOR_RANK = 1 << 20
"""``senders`` that admits every actor rank on rank 0's host (verl's ``multi_sender``)."""


def plan_sender_shares(
    actor_metadata: list[BroadcastMetadata], rollout_world_size: int, senders: int
) -> list[SenderShare]:
    """Split the rollout workers among actor rank 0 and up to ``senders - 1`` relays.

    Relays are the lowest actor ranks whose ``host`` equals actor rank 0's. There are never
    more senders than rollout workers; shares are contiguous and differ by at most one.
    """
    if senders < 1:
        raise ValueError(f"senders must be >= 1, got {senders}")
    home = actor_metadata[0].host
    relays = [rank for rank in range(1, len(actor_metadata))
              if actor_metadata[rank].host == home]
    chosen = [0, *relays][: min(senders, rollout_world_size)]
    share, extra = divmod(rollout_world_size, len(chosen))
    shares, start = [], 0
    for position, sender in enumerate(chosen):
        size = share + (1 if position < extra else 0)
        shares.append(SenderShare(sender, tuple(range(start, start + size))))
        start += size
    return shares


def _master_address(
    sender: BroadcastMetadata, sender_rank: int, members: list[BroadcastMetadata],
    member_ids: tuple[str, ...],
) -> MasterAddress:
    """The sender's address, and whether the previous group of exactly these members can be
    reused (every member reports the same intact group)."""
    previous = sender.group
    reuse = previous is not None and previous.members == member_ids and all(
        member.group == previous for member in members
    )
    port = previous.port if previous is not None and reuse else sender.port
    return MasterAddress(host=sender.host, port=port, reuse=reuse, sender=sender_rank)


def plan_broadcast(
    layout: SyncLayout, metadata: list[BroadcastMetadata]
) -> tuple[list[BroadcastArguments], list[BroadcastArguments]]:
    """Each rank's place in a broadcast sync (see the module docstring): actor rank 0's
    ``senders`` decides how many senders share the rollout workers."""
    actor_meta, rollout_meta = layout.split(metadata)
    shares = plan_sender_shares(actor_meta, layout.rollout_world_size, actor_meta[0].senders)
    idle = BroadcastArguments(rank=-1, world_size=0)
    actor_args = [idle] * layout.actor_ranks
    rollout_args = [idle] * layout.rollout_world_size
    for share in shares:
        members = [actor_meta[share.sender]] + [rollout_meta[r] for r in share.receivers]
        member_ids = tuple(member.member for member in members)
        master = _master_address(actor_meta[share.sender], share.sender, members, member_ids)
        world_size = len(members)
        actor_args[share.sender] = BroadcastArguments(
            rank=0, world_size=world_size, master_metadata=master, members=member_ids)
        for group_rank, receiver in enumerate(share.receivers, start=1):
            rollout_args[receiver] = BroadcastArguments(
                rank=group_rank, world_size=world_size, master_metadata=master,
                members=member_ids)
    return actor_args, rollout_args


def plan_ring(
    layout: SyncLayout, metadata: list[RingMetadata]
) -> tuple[list[RingPlacement], list[RingPlacement]]:
    """Each process's place in the ring: actor rank 0 is position 0, rollout worker ``i`` is
    position ``i + 1``; other actor ranks get position -1 (they only drain their weights).
    Every place carries this sync's ``sync_id`` and the endpoint and name of its neighbours
    (None at the ends of the ring)."""
    actor_meta, rollout_meta = layout.split(metadata)
    sync_id = uuid.uuid4().hex
    chain = [actor_meta[0].endpoint] + [m.endpoint for m in rollout_meta]
    names = [layout.actor_peer_name(0)] + [
        layout.rollout_peer_name(rank) for rank in range(layout.rollout_world_size)
    ]

    def place(position: int) -> RingPlacement:
        has_next = position + 1 < len(chain)
        return RingPlacement(
            position=position, sync_id=sync_id,
            upstream=chain[position - 1] if position > 0 else None,
            upstream_name=names[position - 1] if position > 0 else None,
            downstream=chain[position + 1] if has_next else None,
            downstream_name=names[position + 1] if has_next else None,
        )

    idle = RingPlacement(position=-1, sync_id=sync_id)
    actor_places = [place(0)] + [idle] * (layout.actor_ranks - 1)
    return actor_places, [place(position) for position in range(1, len(chain))]
