"""A small Ray deployment of ``actor_wg`` ranks and rollout replicas for tests and benchmarks."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import ray

from weightsync_core.config import CheckpointEngineConfig, parse_dtype
from weightsync_core.local_ray import ensure_ray
from weightsync_core.manager import CheckpointEngineManager
from weightsync_core.plugins import load_custom_backend_module
from weightsync_core.ray_group import RayRolloutReplica, RayWorkerGroup
from weightsync_core.registry import CheckpointEngineRegistry
from weightsync_core.testing.actors import RecordingRolloutWorker, WeightSourceActor
from weightsync_core.testing.weights import Faults, TensorDigest, digests, make_weights

__all__ = ["Placement", "SyncHarness", "ensure_ray"]


class Placement(Protocol):
    """Where a harness starts its processes (e.g. ``weightsync_testbed.HostPlacement``):
    extra ``ray.remote`` options per actor rank and per replica, merged over
    ``actor_options``."""

    def actor_options(self, rank: int) -> dict[str, Any]:
        """Options of actor rank ``rank``."""
        ...

    def replica_options(self, index: int) -> dict[str, Any]:
        """Options of every worker of the ``index``-th replica the harness starts."""
        ...


class SyncHarness:
    """``actor_world_size`` weight-source ranks and replicas of the given sizes, for one backend.

    Args:
        config: checkpoint-engine config used by every worker.
        actor_world_size: number of ``actor_wg`` ranks.
        replica_sizes: workers per rollout replica; ignored for colocated backends.
        actor_options: extra ``ray.remote`` options of every actor, e.g. ``{"num_gpus": 1}``.
        placement: which host each actor rank and replica goes to (default: wherever Ray
            puts them).
    """

    def __init__(
        self,
        config: CheckpointEngineConfig,
        actor_world_size: int = 2,
        replica_sizes: Sequence[int] = (1, 2),
        actor_options: dict[str, Any] | None = None,
        placement: Placement | None = None,
    ) -> None:
        ensure_ray()
        self.actor_options = {"num_cpus": 0, **(actor_options or {})}
        self.placement = placement
        self.config = config
        load_custom_backend_module(config.custom_backend_module)
        self.colocated = CheckpointEngineRegistry.get(config.backend).is_colocated
        self._source = ray.remote(WeightSourceActor)
        self.actors = [self._new_actor(rank) for rank in range(actor_world_size)]
        self.actor_wg = RayWorkerGroup(self.actors)
        self._replicas_started = 0
        self.replicas: list[RayRolloutReplica] = []
        if not self.colocated:
            self.replicas = [self.new_replica(size, name=f"replica{i}")
                             for i, size in enumerate(replica_sizes)]
        ray.get([actor.report.remote() for actor in self.actors])
        self._ray_ports = self._listening(self.workers())  # before any engine listens

    @staticmethod
    def _listening(workers: Sequence[Any]) -> dict[int, set[str]]:
        reports = ray.get([worker.resources.remote() for worker in workers])
        pids = ray.get([worker.report.remote() for worker in workers])
        return {pid["pid"]: set(report["listening"]) for pid, report in zip(
            pids, reports, strict=True)}

    def engine_ports(self) -> dict[int, list[int]]:
        """Per process (by pid) of the harness's first actors and replicas: the TCP ports
        it listens on beyond Ray's own."""
        return {
            pid: sorted(int(address.rsplit(":", 1)[1])
                        for address in addresses - self._ray_ports.get(pid, set()))
            for pid, addresses in self._listening(self.workers()).items()
        }

    def replace_actor(self, rank: int) -> None:
        """Start a new process for actor rank ``rank`` (after the old one died or was
        killed); managers made from now on use it."""
        with contextlib.suppress(Exception):
            ray.kill(self.actors[rank])
        self.actors[rank] = self._new_actor(rank)
        self.actor_wg = RayWorkerGroup(self.actors)
        self._ray_ports.update(self._listening([self.actors[rank]]))

    def _new_actor(self, rank: int) -> Any:
        placed = self.placement.actor_options(rank) if self.placement else {}
        return self._source.options(**{**self.actor_options, **placed}).remote(self.config)

    def workers(self, replicas: Sequence[RayRolloutReplica] | None = None) -> list[Any]:
        """Every process of the harness: actor ranks, then the rollout workers of
        ``replicas`` (default: all)."""
        chosen = self.replicas if replicas is None else replicas
        return [*self.actors, *(w for replica in chosen for w in replica.workers)]

    def new_replica(self, size: int, name: str | None = None) -> RayRolloutReplica:
        """Start a replica of ``size`` rollout workers (on one host, if placed)."""
        index, self._replicas_started = self._replicas_started, self._replicas_started + 1
        placed = self.placement.replica_options(index) if self.placement else {}
        worker = ray.remote(RecordingRolloutWorker).options(**{**self.actor_options, **placed})
        return RayRolloutReplica([worker.remote(self.config) for _ in range(size)], name=name)

    def manager(
        self, replicas: Sequence[RayRolloutReplica] | None = None, **config_overrides: Any
    ) -> CheckpointEngineManager:
        """A manager over ``replicas`` (default: all), with optional config overrides."""
        config = replace(self.config, **config_overrides)
        chosen = self.replicas if replicas is None else replicas
        return CheckpointEngineManager(config, self.actor_wg, chosen)

    def set_weights(
        self, seed: int, profile: str = "standard", faults: Faults | None = None
    ) -> dict[str, TensorDigest]:
        """Give every actor rank the weights of ``seed``; return the digests receivers
        should report."""
        ray.get([actor.set_weights.remote(seed, profile, faults) for actor in self.actors])
        weights = make_weights(seed, self.config.bucket_size_bytes, profile)
        return digests(weights, parse_dtype(self.config.rollout_dtype))

    def reports(self, replicas: Sequence[RayRolloutReplica] | None = None) -> list[dict[str, Any]]:
        """Per receiving process (rollout worker, or actor rank if colocated): what arrived."""
        if self.colocated:
            return ray.get([actor.report.remote() for actor in self.actors])
        chosen = self.replicas if replicas is None else replicas
        return ray.get([w.report.remote() for replica in chosen for w in replica.workers])

    def shutdown(self) -> None:
        """Kill every actor this harness started."""
        for handle in [*self.actors, *(w for r in self.replicas for w in r.workers)]:
            ray.kill(handle)
