"""A small Ray deployment of ``actor_wg`` ranks and rollout replicas for tests: a
:class:`~weightsync_core.orchestration.deployment.Deployment` whose processes record what
they receive and take injected faults."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import ray

from weightsync_core.api.config import CheckpointEngineConfig, parse_dtype
from weightsync_core.orchestration.deployment import Deployment, Placement
from weightsync_core.orchestration.local_ray import ensure_ray
from weightsync_core.orchestration.ray_group import RayRolloutReplica, RayWorkerGroup
from weightsync_core.testing.actors import RecordingRolloutWorker, WeightSourceActor
from weightsync_core.testing.weights import (
    Faults,
    TensorDigest,
    digests,
    make_weights,
    sparse_updates,
)

__all__ = ["Placement", "SyncHarness", "ensure_ray"]


class SyncHarness(Deployment):
    """``actor_world_size`` weight-source ranks and replicas of the given sizes, for one backend.

    Its actor ranks hold test weights (:meth:`set_weights`, with optional faults) and its
    rollout workers record a digest of every received tensor (:meth:`reports`; their
    ``set_faults`` makes them die, stall or go slow).

    Its arguments are :class:`~weightsync_core.orchestration.deployment.Deployment`'s.

    Starting a Ray process (Python, torch, the backend) is most of what a small test costs.
    :meth:`prestart` starts the processes that later :meth:`new_replica` and
    :meth:`replace_actor` calls will need, a few at a time, ahead of those calls, so that
    they boot while earlier tests run; each is still a fresh, unused process, placed where
    the call would have placed it.
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
        self._planned: list[tuple[str, int]] = []  # ("replica", size) | ("actor", rank)
        self._spares: list[tuple[str, int, dict[str, Any], list[Any]]] = []
        self._ahead = 0
        super().__init__(config, actor_world_size, replica_sizes, actor_options, placement)
        self._plan_index = self._replicas_started
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

    # -- processes started ahead of need ----------------------------------------------------
    def prestart(self, needs: Iterable[tuple[str, int]], ahead: int = 3) -> None:
        """Plan processes for later calls, in the order the calls will come: ``("replica",
        size)`` for a :meth:`new_replica` of that size, ``("actor", rank)`` for a
        :meth:`replace_actor` of that rank. Keeps up to ``ahead`` of them started and unused;
        a call that finds no matching one starts its own, as without a plan; :meth:`shutdown`
        kills those never used."""
        for kind, number in needs:
            if kind not in ("replica", "actor"):
                raise ValueError(f"prestart needs ('replica', size) or ('actor', rank), "
                                 f"got {(kind, number)!r}")
            self._planned.append((kind, number))
        self._ahead = ahead
        self._top_up()

    def _top_up(self) -> None:
        while self._planned and sum(len(s[3]) for s in self._spares) < self._ahead:
            kind, number = self._planned.pop(0)
            if kind == "actor":
                placed = self.placement.actor_options(number) if self.placement else {}
                self._spares.append((kind, number, placed, [self._new_actor(number)]))
                continue
            placed = self._replica_options(self._plan_index)
            self._plan_index += 1
            worker = ray.remote(self.worker_class).options(**{**self.actor_options, **placed})
            self._spares.append(
                (kind, number, placed, [worker.remote(self.config) for _ in range(number)]))

    def _replica_options(self, index: int) -> dict[str, Any]:
        return self.placement.replica_options(index) if self.placement else {}

    def _take_spare(self, kind: str, number: int, placed: dict[str, Any]) -> list[Any] | None:
        for spare in self._spares:
            if spare[:3] == (kind, number, placed):
                self._spares.remove(spare)
                self._top_up()
                return spare[3]
        return None

    def new_replica(self, size: int, name: str | None = None) -> RayRolloutReplica:
        """Start a replica of ``size`` rollout workers (on one host, if placed), or take the
        started, unused one :meth:`prestart` made for this call."""
        if self._spares:
            workers = self._take_spare("replica", size, self._replica_options(
                self._replicas_started))
            if workers is not None:
                self._replicas_started += 1
                return RayRolloutReplica(workers, name=name)
        return super().new_replica(size, name)

    def shutdown(self) -> None:
        """Kill every process of the deployment, and the started spares no call took."""
        super().shutdown()
        for *_, handles in self._spares:
            for handle in handles:
                ray.kill(handle)
        self._spares, self._planned = [], []

    def replace_actor(self, rank: int) -> None:
        """Start a new process for actor rank ``rank`` (after the old one died or was
        killed), or take the one :meth:`prestart` started for it; managers made from now on
        use it."""
        with contextlib.suppress(Exception):
            ray.kill(self.actors[rank])
        placed = self.placement.actor_options(rank) if self.placement else {}
        spare = self._take_spare("actor", rank, placed)
        self.actors[rank] = spare[0] if spare else self._new_actor(rank)
        self.actor_wg = RayWorkerGroup(self.actors)
        self._ray_ports.update(self._listening([self.actors[rank]]))

    weights_profile: str = "standard"
    """The weights profile :meth:`set_weights` uses unless told another
    (:func:`~weightsync_core.testing.weights.make_weights`)."""

    def set_weights(
        self, seed: int, profile: str | None = None, faults: Faults | None = None,
        updates: Sequence[tuple[int, float]] = (),
    ) -> dict[str, TensorDigest]:
        """Give every actor rank the weights of ``seed`` (of ``profile``, by default
        :attr:`weights_profile`) after the sparse ``updates``
        (:func:`~weightsync_core.testing.weights.sparse_updates`); return the digests
        receivers should report."""
        profile = profile or self.weights_profile
        ray.get([actor.set_weights.remote(seed, profile, faults, updates)
                 for actor in self.actors])
        weights = sparse_updates(
            make_weights(seed, self.config.bucket_size_bytes, profile), updates)
        return digests(weights, parse_dtype(self.config.rollout_dtype))

    def reports(self, replicas: Sequence[RayRolloutReplica] | None = None) -> list[dict[str, Any]]:
        """Per receiving process (rollout worker, or actor rank if colocated): what arrived."""
        if self.colocated:
            return ray.get([actor.report.remote() for actor in self.actors])
        chosen = self.replicas if replicas is None else replicas
        return ray.get([w.report.remote() for replica in chosen for w in replica.workers])
