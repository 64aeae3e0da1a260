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
them once as a :class:`~weightsync_core.data.sync_layout.SyncLayout`, which also splits the
metadata per side and names the peers. They check every process's metadata before reading
it (:func:`check_metadata`): a process whose ``prepare()`` returned something else than its
engine does (not a dict, a key missing, a value of the wrong kind) is named in a
:class:`~weightsync_core.api.errors.MetadataError`, never met as a bare ``KeyError``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync_core.api.errors import MetadataError
from weightsync_core.data.sync_layout import SyncLayout

__all__ = [
    "BroadcastGroup",
    "MetadataField",
    "broadcast_topology",
    "check_metadata",
    "plan_broadcast_groups",
    "ring_topology",
]


@dataclass(frozen=True)
class MetadataField:
    """What one key of a process's metadata must hold.

    Attributes:
        accepts: whether a value is acceptable.
        words: what is accepted, in words (``"a non-empty string"``).
        optional: the key may be missing.
    """

    accepts: Callable[[Any], bool]
    words: str
    optional: bool = False


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _is_port(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_group(value: Any) -> bool:
    return value is None or (isinstance(value, Mapping) and _is_port(value.get("port"))
                             and "members" in value)


TEXT = MetadataField(_is_text, "a non-empty string")
PORT = MetadataField(_is_port, "a port number (an integer from 1 to 65535)")
BROADCAST_METADATA: Mapping[str, MetadataField] = {
    "host": TEXT,
    "port": PORT,
    "member": TEXT,
    "group": MetadataField(_is_group, "None or a group ({'port': ..., 'members': [...]})",
                           optional=True),
    "senders": MetadataField(_is_count, "an integer >= 1", optional=True),
}
"""What each process's metadata holds for :func:`broadcast_topology`."""
RING_METADATA: Mapping[str, MetadataField] = {"endpoint": TEXT}
"""What each process's metadata holds for :func:`ring_topology`."""


def _peer_name(layout: SyncLayout, index: int) -> str:
    """The engines' name of the process at ``index`` of the metadata."""
    if index < layout.actor_ranks:
        return layout.actor_peer_name(index)
    return layout.rollout_peer_name(index - layout.actor_ranks)


def _short(value: Any) -> str:
    """``repr(value)``, cut to a length an error message can carry."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _metadata_problem(entry: Any, fields: Mapping[str, MetadataField]) -> str | None:
    """What is wrong with one process's metadata, as "returned metadata <problem>", or
    None."""
    if not isinstance(entry, Mapping):
        return f"that is not a dict but {type(entry).__name__} {_short(entry)}"
    for key, field in fields.items():
        if key not in entry:
            if not field.optional:
                return f"without {key!r} (it holds {', '.join(map(repr, entry)) or 'nothing'})"
        elif not field.accepts(entry[key]):
            return f"whose {key!r} is {_short(entry[key])}, not {field.words}"
    return None


def check_metadata(
    layout: SyncLayout, metadata: Sequence[Any], fields: Mapping[str, MetadataField]
) -> None:
    """Check that every process's ``prepare()`` metadata (actor ranks first, then the
    rollout workers of ``layout``) is a dict holding ``fields``.

    Raises:
        MetadataError: naming the first process whose metadata is wrong (its ``index``),
            what is wrong and what it returned.
    """
    for index, entry in enumerate(metadata):
        problem = _metadata_problem(entry, fields)
        if problem is not None:
            raise MetadataError(
                f"{_peer_name(layout, index)} returned metadata {problem} from prepare(); "
                "every process of the sync must run the same engine, whose prepare() "
                f"returns {', '.join(fields)}",
                index=index, problem=problem,
            )


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

    Raises:
        MetadataError: a process's metadata is not that (naming the process).
    """
    layout = _layout("broadcast", actor_wg_world_size, rollout_world_size)
    actor_meta, rollout_meta = layout.split(metadata)
    check_metadata(layout, metadata, BROADCAST_METADATA)
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

    Raises:
        MetadataError: a process's metadata holds no ``endpoint`` (naming the process).
    """
    layout = _layout("ring", actor_wg_world_size, rollout_world_size)
    actor_meta, rollout_meta = layout.split(metadata)
    check_metadata(layout, metadata, RING_METADATA)
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
