"""The kimi topology, typed: every actor rank serves its share; one leader per replica
pulls."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from weightsync_core.spi import CheckpointEngineRegistry, Handshake, SyncLayout, Text
from weightsync_kimi.shares import ShareManifest

__all__ = ["KimiMetadata", "KimiPlan", "Owner", "plan_kimi"]


class KimiMetadata(Handshake, frozen=True, kw_only=True):
    """What a process of a kimi sync announces.

    Attributes:
        endpoint: its control channel.
        peer: its transport metadata (how a leader reaches its buckets).
        cache: on an actor rank, the share it holds from the last update, if any.
        collective: the backend of the replica's broadcast group.
        inner: that group's engine's ``prepare()`` metadata (checked by its own topology).
    """

    endpoint: Text
    peer: Text
    cache: ShareManifest | None = None
    collective: Text
    inner: dict[str, Any]


class Owner(Handshake, frozen=True, kw_only=True):
    """An actor rank as a replica leader sees it.

    Attributes:
        endpoint: its control channel.
        peer: its transport metadata.
        cache: the share it holds from the last update, if any.
    """

    endpoint: Text
    peer: Text
    cache: ShareManifest | None = None


class KimiPlan(Handshake, frozen=True, kw_only=True):
    """One process's part in a kimi sync (what ``init_process_group`` takes).

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
    sync_id: Text
    inner: dict[str, Any] | None = None
    owners: tuple[Owner, ...] = ()
    rank: int = 0
    world_size: int = 0
    leaders: tuple[str, ...] = ()

    @property
    def has_replica_group(self) -> bool:
        """True if this process belongs to a replica broadcast group."""
        return self.inner is not None


def _inner_plans(members: list[KimiMetadata]) -> list[dict[str, Any] | None]:
    """``init_process_group`` arguments of the replica's own broadcast group (leader first),
    or ``None`` for a single-worker replica."""
    if len(members) == 1:
        return [None]
    inner_cls = CheckpointEngineRegistry.get(members[0].collective)
    leader, others = inner_cls.build_topology(1, len(members) - 1, [m.inner for m in members])
    plans: list[dict[str, Any] | None] = [{key: values[0] for key, values in leader.items()}]
    plans += [{key: values[i] for key, values in others.items()} for i in range(len(members) - 1)]
    return plans


def plan_kimi(
    layout: SyncLayout, metadata: list[KimiMetadata]
) -> tuple[list[KimiPlan], list[KimiPlan]]:
    """Each process's :class:`KimiPlan`. Actor ranks are ``owner``s and send their share to
    every replica's ``leader`` (its first worker), which pulls all buckets and relays them to
    the replica's other workers (``member``s) over the replica's broadcast group."""
    sync_id = uuid.uuid4().hex
    actor_meta, rollout_meta = layout.split(metadata)
    owners = tuple(Owner(endpoint=m.endpoint, peer=m.peer, cache=m.cache) for m in actor_meta)
    rollout_plans: list[KimiPlan] = []
    leaders = []
    for replica in range(layout.num_replicas):
        members = [rollout_meta[rank] for rank in layout.replica_ranks(replica)]
        leaders.append(members[0].endpoint)
        rollout_plans += [
            KimiPlan(role="leader", sync_id=sync_id, inner=inner, owners=owners) if local == 0
            else KimiPlan(role="member", sync_id=sync_id, inner=inner)
            for local, inner in enumerate(_inner_plans(members))
        ]
    actor_plans = [
        KimiPlan(role="owner", sync_id=sync_id, rank=rank, world_size=layout.actor_ranks,
                 leaders=tuple(leaders))
        for rank in range(layout.actor_ranks)
    ]
    return actor_plans, rollout_plans
