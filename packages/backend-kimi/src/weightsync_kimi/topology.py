"""The kimi topology: every actor rank serves its share; one leader per replica pulls."""

from __future__ import annotations

import uuid
from typing import Any

from weightsync_core.spi import (
    CheckpointEngineRegistry,
)

__all__ = ["kimi_topology"]


def _inner_plans(members: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """``init_process_group`` arguments of the replica's own broadcast group (leader first),
    or ``None`` for a single-worker replica."""
    if len(members) == 1:
        return [None]
    inner_cls = CheckpointEngineRegistry.get(members[0]["collective"])
    leader, others = inner_cls.build_topology(1, len(members) - 1, [m["inner"] for m in members])
    plans = [{key: values[0] for key, values in leader.items()}]
    plans += [{key: values[i] for key, values in others.items()} for i in range(len(members) - 1)]
    return plans


def kimi_topology(
    actor_wg_world_size: int, replica_sizes: list[int], metadata: list[dict[str, Any]]
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Per-rank ``plan`` arguments. Actor ranks are ``owner``s and send their share to every
    replica's ``leader`` (its first worker), which pulls all buckets and relays them to the
    replica's other workers (``member``s) over the replica's broadcast group.

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
    actor_meta = metadata[:actor_wg_world_size]
    owners = [{"endpoint": m["endpoint"], "peer": m["peer"], "cache": m["cache"]}
              for m in actor_meta]
    rollout_plans: list[dict[str, Any]] = []
    leaders = []
    start = actor_wg_world_size
    for size in replica_sizes:
        members = metadata[start : start + size]
        start += size
        leaders.append(members[0]["endpoint"])
        for local, inner in enumerate(_inner_plans(members)):
            plan = {"role": "leader" if local == 0 else "member", "sync_id": sync_id,
                    "inner": inner}
            if local == 0:
                plan["owners"] = owners
            rollout_plans.append(plan)
    actor_plans = [
        {"role": "owner", "sync_id": sync_id, "rank": rank, "inner": None,
         "world_size": actor_wg_world_size, "leaders": leaders}
        for rank in range(actor_wg_world_size)
    ]
    return {"plan": actor_plans}, {"plan": rollout_plans}
