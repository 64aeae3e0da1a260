"""Putting actor ranks and replicas on chosen emulated hosts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weightsync_testbed.cluster import host_resource

__all__ = ["HostPlacement", "SpreadPlacement", "on_host"]


def on_host(host: str) -> dict[str, Any]:
    """``ray.remote``/``.options`` arguments that put an actor on ``host``."""
    return {"resources": {host_resource(host): 1}}


@dataclass(frozen=True)
class HostPlacement:
    """Actor rank ``r`` on ``actors[r % len(actors)]``; every worker of the ``i``-th replica
    started on ``replicas[i % len(replicas)]`` (a replica never spans hosts, as a rollout
    server's GPUs share one node). Implements the harness's placement hook
    (:class:`weightsync_core.testing.Placement`)."""

    actors: list[str]
    replicas: list[str]

    def __post_init__(self) -> None:
        if not self.actors or not self.replicas:
            raise ValueError("place actor ranks and replicas on at least one host each")

    def actor_host(self, rank: int) -> str:
        """The host of actor rank ``rank``."""
        return self.actors[rank % len(self.actors)]

    def replica_host(self, index: int) -> str:
        """The host of the ``index``-th replica started."""
        return self.replicas[index % len(self.replicas)]

    def actor_options(self, rank: int) -> dict[str, Any]:
        """Ray options of actor rank ``rank``."""
        return on_host(self.actor_host(rank))

    def replica_options(self, index: int) -> dict[str, Any]:
        """Ray options of every worker of the ``index``-th replica."""
        return on_host(self.replica_host(index))


@dataclass(frozen=True)
class SpreadPlacement:
    """Every process on a host of its own: actor rank ``r`` on ``actors[r]``, worker ``w`` of
    the ``i``-th replica started on ``workers[i * workers_per_replica + w]`` (GPU hosts with
    a NIC per GPU, each inference rank on its own NIC). Implements the deployment's
    per-worker placement hook
    (:class:`weightsync_core.orchestration.deployment.WorkerPlacement`)."""

    actors: list[str]
    workers: list[str]
    workers_per_replica: int

    def __post_init__(self) -> None:
        if not self.actors or not self.workers or self.workers_per_replica < 1:
            raise ValueError("place actor ranks and workers on at least one host each, and "
                             "give replicas at least one worker")

    def actor_options(self, rank: int) -> dict[str, Any]:
        """Ray options of actor rank ``rank``."""
        return on_host(self.actors[rank % len(self.actors)])

    def replica_options(self, index: int) -> dict[str, Any]:
        """Ray options of the ``index``-th replica's first worker."""
        return self.worker_options(index, 0)

    def worker_options(self, index: int, worker: int) -> dict[str, Any]:
        """Ray options of worker ``worker`` of the ``index``-th replica started."""
        host = self.workers[(index * self.workers_per_replica + worker) % len(self.workers)]
        return on_host(host)
