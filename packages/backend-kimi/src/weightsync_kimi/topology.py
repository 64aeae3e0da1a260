"""The kimi topology: every actor rank serves its share; one leader per replica pulls."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from weightsync_core.spi import (
    CheckpointEngineRegistry,
)
from weightsync_kimi.shares import ShareManifest

__all__ = ["KimiPlan", "Owner", "kimi_topology"]


@dataclass(frozen=True)
class Owner:
    """An actor rank as a replica leader sees it.

    Attributes:
        endpoint: its control channel.
        peer: its transport metadata.
        cache: the share it holds from the last update, if any.
    """

    endpoint: str
    peer: Any
    cache: ShareManifest | None = None


@dataclass(frozen=True)
class KimiPlan:
    """One process's part in a kimi sync (what ``init_process_group`` receives).

    Attributes:
        role: ``"owner"`` (an actor rank serving its share), ``"leader"`` (a replica's
            first worker: pulls every share and relays it) or ``"member"`` (another worker
            of the replica: receives the relay).
        sync_id: the sync, equal in every plan of it.
        inner: ``init_process_group`` arguments of the replica's broadcast group (None
            for actor ranks and single-worker replicas).
        owners: a leader's view of every actor rank, by rank (empty for other roles).
        rank: an owner's actor rank.
        world_size: the number of owners (set in an owner's plan).
        leaders: an owner's replica leaders' endpoints, to publish its share to.
    """

    role: Literal["owner", "leader", "member"]
    sync_id: str
    inner: dict[str, Any] | None = None
    owners: tuple[Owner, ...] = ()
    rank: int = 0
    world_size: int = 0
    leaders: tuple[str, ...] = ()

    @property
    def has_replica_group(self) -> bool:
        """True if this process belongs to a replica broadcast group."""
        return self.inner is not None


def _inner_plans(members: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """``init_process_group`` arguments of the replica's own broadcast group (leader first),
    or ``None`` for a single-worker replica."""
    if len(members) == 1:
        return [None]
    inner_cls = CheckpointEngineRegistry.get(members[0]["collective"])
    leader, others = inner_cls.build_topology(1, len(members) - 1, [m["inner"] for m in members])
    plans: list[dict[str, Any] | None] = [{key: values[0] for key, values in leader.items()}]
    plans += [{key: values[i] for key, values in others.items()} for i in range(len(members) - 1)]
    return plans


def kimi_topology(
    actor_wg_world_size: int, replica_sizes: list[int], metadata: list[dict[str, Any]]
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Per-rank ``plan`` arguments (:class:`KimiPlan`). Actor ranks are ``owner``s and send
    their share to every replica's ``leader`` (its first worker), which pulls all buckets and
    relays them to the replica's other workers (``member``s) over the replica's broadcast
    group.

    ``metadata`` entries carry ``endpoint``, ``peer`` (transport metadata), ``cache`` (the
    share an actor rank holds from the last update), ``collective`` and ``inner`` (the
    replica group's ``prepare`` result).
    """
    if actor_wg_world_size < 1 or not replica_sizes or min(replica_sizes) < 1:
        raise ValueError(
            "kimi needs at least one actor rank and non-empty replicas, got "
            f"actor_wg_world_size={actor_wg_world_size}, replica_sizes={replica_sizes}"
        )
    sync_id = uuid.uuid4().hex
    owners = tuple(Owner(m["endpoint"], m["peer"], m["cache"])
                   for m in metadata[:actor_wg_world_size])
    rollout_plans: list[KimiPlan] = []
    leaders = []
    start = actor_wg_world_size
    for size in replica_sizes:
        members = metadata[start : start + size]
        start += size
        leaders.append(members[0]["endpoint"])
        rollout_plans += [
            KimiPlan("leader", sync_id, inner, owners) if local == 0
            else KimiPlan("member", sync_id, inner)
            for local, inner in enumerate(_inner_plans(members))
        ]
    actor_plans = [
        KimiPlan("owner", sync_id, rank=rank, world_size=actor_wg_world_size,
                 leaders=tuple(leaders))
        for rank in range(actor_wg_world_size)
    ]
    return {"plan": actor_plans}, {"plan": rollout_plans}
