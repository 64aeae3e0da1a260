"""Topologies: which actor ranks send, and to which rollout workers.

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

The builders take the sizes an engine's ``build_topology`` gets (verl's signature) and check
them once as a :class:`~weightsync_core.sync_layout.SyncLayout`, which also splits the
metadata per side and names the peers.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from weightsync_core.sync_layout import SyncLayout

__all__ = ["BroadcastGroup", "broadcast_topology", "plan_broadcast_groups", "ring_topology"]


@dataclass(frozen=True)
class BroadcastGroup:
    """One sender and the rollout workers it serves (indices into each side's ranks)."""

    sender: int
    receivers: tuple[int, ...]


EVERY_LOCAL_ACTOR_RANK = 1 << 20
"""``senders`` that admits every actor rank on rank 0's host (verl's ``multi_sender``)."""


def plan_broadcast_groups(
    actor_metadata: list[dict[str, Any]], rollout_world_size: int, senders: int
) -> list[BroadcastGroup]:
    """Split the rollout workers among actor rank 0 and up to ``senders - 1`` relays.

    Relays are the lowest actor ranks whose ``host`` equals actor rank 0's. There are never
    more senders than rollout workers; shares are contiguous and differ by at most one.
    """
    if senders < 1:
        raise ValueError(f"senders must be >= 1, got {senders}")
    home = actor_metadata[0]["host"]
    relays = [rank for rank in range(1, len(actor_metadata))
              if actor_metadata[rank]["host"] == home]
    chosen = [0, *relays][: min(senders, rollout_world_size)]
    share, extra = divmod(rollout_world_size, len(chosen))
    groups, start = [], 0
    for position, sender in enumerate(chosen):
        size = share + (1 if position < extra else 0)
        groups.append(BroadcastGroup(sender, tuple(range(start, start + size))))
        start += size
    return groups


def _master_metadata(
    sender: dict[str, Any], sender_rank: int, members: list[dict[str, Any]], member_ids: list[str]
) -> dict[str, Any]:
    """The sender's address, and whether the previous group of exactly these members can be
    reused (every member reports the same intact group)."""
    previous = sender.get("group")
    reuse = previous is not None and previous["members"] == member_ids and all(
        member.get("group") == previous for member in members
    )
    port = previous["port"] if previous is not None and reuse else sender["port"]
    return {"host": sender["host"], "port": port, "reuse": reuse, "sender": sender_rank}


def _layout(kind: str, actor_wg_world_size: int, rollout_world_size: int) -> SyncLayout:
    """The layout ``build_topology`` is given (sizes only): at least one process a side."""
    if actor_wg_world_size < 1 or rollout_world_size < 1:
        raise ValueError(
            f"a {kind} needs at least one actor rank and one rollout worker, got "
            f"actor_wg_world_size={actor_wg_world_size}, rollout_world_size={rollout_world_size}"
        )
    return SyncLayout.flat(actor_wg_world_size, rollout_world_size)


def broadcast_topology(
    actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """``build_topology`` of the collective-broadcast engines (see module docstring).

    ``metadata`` entries carry ``host``, ``port``, ``member`` (a unique id), ``group`` (the
    intact group the process holds, or None) and, on actor ranks, ``senders``.
    """
    layout = _layout("broadcast", actor_wg_world_size, rollout_world_size)
    actor_meta, rollout_meta = layout.split(metadata)
    groups = plan_broadcast_groups(
        actor_meta, layout.rollout_world_size, actor_meta[0].get("senders", 1)
    )
    idle = {"rank": -1, "world_size": 0, "master_metadata": None, "members": None}
    actor_kwargs = [dict(idle) for _ in range(layout.actor_ranks)]
    rollout_kwargs: list[dict[str, Any]] = [{} for _ in range(layout.rollout_world_size)]
    for group in groups:
        members = [actor_meta[group.sender]] + [rollout_meta[r] for r in group.receivers]
        member_ids = [member["member"] for member in members]
        master = _master_metadata(actor_meta[group.sender], group.sender, members, member_ids)
        world_size = len(members)
        actor_kwargs[group.sender] = {
            "rank": 0, "world_size": world_size, "master_metadata": master, "members": member_ids,
        }
        for group_rank, receiver in enumerate(group.receivers, start=1):
            rollout_kwargs[receiver] = {
                "rank": group_rank, "world_size": world_size, "master_metadata": master,
                "members": member_ids,
            }
    keys = ("rank", "world_size", "master_metadata", "members")
    return (
        {key: [kwargs[key] for kwargs in actor_kwargs] for key in keys},
        {key: [kwargs[key] for kwargs in rollout_kwargs] for key in keys},
    )


def ring_topology(
    actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """``build_topology`` of the ring engines: actor rank 0 is ring position 0, rollout
    worker ``i`` is position ``i + 1``; other actor ranks get position ``-1`` (they only
    drain their weights).

    ``metadata`` entries carry ``endpoint`` (the control-channel address). Every process
    gets its ``position``, the ``sync_id`` of this sync, and the endpoint and name of its
    ``upstream`` and ``downstream`` neighbours (``None`` at the ends of the ring).
    """
    layout = _layout("ring", actor_wg_world_size, rollout_world_size)
    actor_meta, rollout_meta = layout.split(metadata)
    sync_id = uuid.uuid4().hex
    chain = [actor_meta[0]["endpoint"]] + [m["endpoint"] for m in rollout_meta]
    names = [layout.actor_peer_name(0)] + [
        layout.rollout_peer_name(rank) for rank in range(layout.rollout_world_size)
    ]

    def place(position: int) -> dict[str, Any]:
        has_next = position + 1 < len(chain)
        return {
            "position": position,
            "sync_id": sync_id,
            "upstream": chain[position - 1] if position > 0 else None,
            "upstream_name": names[position - 1] if position > 0 else None,
            "downstream": chain[position + 1] if has_next else None,
            "downstream_name": names[position + 1] if has_next else None,
        }

    idle = {"position": -1, "sync_id": sync_id, "upstream": None, "upstream_name": None,
            "downstream": None, "downstream_name": None}
    actor_kwargs = [place(0)] + [dict(idle) for _ in range(layout.actor_ranks - 1)]
    rollout_kwargs = [place(position) for position in range(1, len(chain))]
    keys = list(idle)
    return (
        {key: [kwargs[key] for kwargs in actor_kwargs] for key in keys},
        {key: [kwargs[key] for kwargs in rollout_kwargs] for key in keys},
    )
