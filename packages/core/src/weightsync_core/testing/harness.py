"""A small Ray deployment of ``actor_wg`` ranks and rollout replicas for tests: a
:class:`~weightsync_core.deployment.Deployment` whose processes record what they receive and
take injected faults."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import ray

from weightsync_core.config import CheckpointEngineConfig, parse_dtype
from weightsync_core.deployment import Deployment, Placement
from weightsync_core.local_ray import ensure_ray
from weightsync_core.ray_group import RayRolloutReplica, RayWorkerGroup
from weightsync_core.testing.actors import RecordingRolloutWorker, WeightSourceActor
from weightsync_core.testing.weights import Faults, TensorDigest, digests, make_weights

__all__ = ["Placement", "SyncHarness", "ensure_ray"]


class SyncHarness(Deployment):
    """``actor_world_size`` weight-source ranks and replicas of the given sizes, for one backend.

    Its actor ranks hold test weights (:meth:`set_weights`, with optional faults) and its
    rollout workers record a digest of every received tensor (:meth:`reports`; their
    ``set_faults`` makes them die, stall or go slow).

    Its arguments are :class:`~weightsync_core.deployment.Deployment`'s.
    """

    source_class = WeightSourceActor
    worker_class = RecordingRolloutWorker

    def __init__(
        self,
        config: CheckpointEngineConfig,
        actor_world_size: int = 2,
        replica_sizes: Sequence[int] = (1, 2),
        actor_options: dict[str, Any] | None = None,
        placement: Placement | None = None,
    ) -> None:
        super().__init__(config, actor_world_size, replica_sizes, actor_options, placement)
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
