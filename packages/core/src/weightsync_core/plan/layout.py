"""What a plan is computed for: links, the cluster's layout, and the weights to move."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from weightsync_core.data.sync_layout import SyncLayout

__all__ = ["Cluster", "Link", "Workload"]


@dataclass(frozen=True)
class Link:
    """One direction of a link (links are full duplex).

    Args:
        bandwidth: payload bytes per second one stream reaches (goodput, not the nominal
            rate: ``--measure`` probes it; a nominal rate loses about 4% to TCP/IP headers).
        latency: one-way latency in seconds.
    """

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"a link's bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"a link's latency must be >= 0 s, got {self.latency!r}")

    def seconds(self, nbytes: float, copies: int = 1) -> float:
        """Time to move ``copies`` copies of ``nbytes`` one after another over this link."""
        return self.latency + copies * nbytes / self.bandwidth


@dataclass(frozen=True)
class Cluster:
    """Where the actor ranks and rollout workers run, and the links between them.

    Actor ranks fill ``actor_hosts`` hosts of ``actor_ranks_per_host``; rollout workers
    (``replicas`` x ``workers_per_replica``, replica by replica) fill hosts of their own,
    ``rollout_workers_per_host`` each. Every host has ``nics_per_host`` NICs of ``nic``
    (GPU hosts: often one a GPU), each process using one (the busiest processes of a host
    share them evenly); processes on one host talk over ``intra_host`` (NVLink between
    GPUs; loopback between CPU processes).

    ``shared_cpu_cores`` is for emulations only: every process of every host shares that
    many cores (the testbed), so per-bucket CPU work stretches when more processes than cores
    are busy. ``None`` (a real cluster): each process has a core of its own.

    Its :attr:`layout` (a :class:`~weightsync_core.data.sync_layout.SyncLayout`, as the manager
    builds for a sync) holds the actor ranks, the replicas' workers and every process's
    host; the topologies read them from there.
    """

    nic: Link
    intra_host: Link
    actor_hosts: int = 1
    actor_ranks_per_host: int = 1
    replicas: int = 1
    workers_per_replica: int = 1
    rollout_workers_per_host: int = 1
    shared_cpu_cores: int | None = None
    nics_per_host: int = 1

    def __post_init__(self) -> None:
        for name in ("actor_hosts", "actor_ranks_per_host", "replicas", "workers_per_replica",
                     "rollout_workers_per_host", "nics_per_host"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.shared_cpu_cores is not None and self.shared_cpu_cores < 1:
            raise ValueError(f"shared_cpu_cores must be >= 1 or None, got "
                             f"{self.shared_cpu_cores!r}")

    @cached_property
    def layout(self) -> SyncLayout:
        """The sync's layout on this cluster: actor ranks fill ``actor host 0``, ``1``, ...
        in rank order, ``actor_ranks_per_host`` each; rollout workers fill ``rollout host
        0``, ``1``, ... in rollout-rank order, ``rollout_workers_per_host`` each."""
        actor_ranks = self.actor_hosts * self.actor_ranks_per_host
        rollout_workers = self.replicas * self.workers_per_replica
        return SyncLayout(
            actor_ranks, (self.workers_per_replica,) * self.replicas,
            actor_rank_hosts=tuple(f"actor host {rank // self.actor_ranks_per_host}"
                                   for rank in range(actor_ranks)),
            rollout_rank_hosts=tuple(f"rollout host {worker // self.rollout_workers_per_host}"
                                     for worker in range(rollout_workers)),
        )

    @property
    def actor_ranks(self) -> int:
        """Actor ranks in all."""
        return self.layout.actor_ranks

    @property
    def rollout_workers(self) -> int:
        """Rollout workers in all."""
        return self.layout.rollout_world_size

    @property
    def rollout_hosts(self) -> int:
        """Hosts the rollout workers fill."""
        return math.ceil(self.rollout_workers / self.rollout_workers_per_host)

    def actor_host(self, rank: int) -> str:
        """The host of actor rank ``rank`` (ranks fill hosts in rank order)."""
        return self._hosts(self.layout.actor_rank_hosts)[rank]

    def rollout_host(self, worker: int) -> str:
        """The host of rollout worker ``worker`` (workers fill hosts in rank order)."""
        return self._hosts(self.layout.rollout_rank_hosts)[worker]

    @staticmethod
    def _hosts(hosts: tuple[str, ...] | None) -> tuple[str, ...]:
        assert hosts is not None  # the cluster's layout always knows its hosts
        return hosts

    def cpu_contention(self, busy_processes: int) -> float:
        """How much longer per-bucket CPU work takes with ``busy_processes`` at work at
        once: 1 on a real cluster; processes over cores on a shared-core emulation."""
        if self.shared_cpu_cores is None:
            return 1.0
        return max(1.0, busy_processes / self.shared_cpu_cores)


@dataclass(frozen=True)
class Workload:
    """The weights of one sync.

    Args:
        model_bytes: bytes every rollout worker receives (after any dtype cast).
        bucket_bytes: the engine's bucket size.
        largest_tensor_bytes: the largest single tensor. weightsync splits a tensor larger
            than a bucket into chunks, so it costs no time, but a receiver holds it whole
            while merging (see :attr:`receiver_memory_bytes`).
        pipeline_depth: buckets in flight through a multi-stage pipeline (2 = double
            buffering; kimi's slots). It binds only where stages outnumber buffers.
    """

    model_bytes: int
    bucket_bytes: int
    largest_tensor_bytes: int = 0
    pipeline_depth: int = 2

    def __post_init__(self) -> None:
        if self.model_bytes < 1 or self.bucket_bytes < 1:
            raise ValueError(f"model_bytes and bucket_bytes must be >= 1, got "
                             f"{self.model_bytes!r} and {self.bucket_bytes!r}")
        if self.pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {self.pipeline_depth!r}")
        if self.largest_tensor_bytes > self.model_bytes:
            raise ValueError("largest_tensor_bytes cannot exceed model_bytes")

    @property
    def buckets(self) -> int:
        """Buckets of one sync."""
        return math.ceil(self.model_bytes / self.bucket_bytes)

    @property
    def receiver_memory_bytes(self) -> int:
        """Host or device memory a rollout worker needs for the sync: its bucket buffers and
        the largest tensor while its chunks are merged."""
        merge = self.largest_tensor_bytes if self.largest_tensor_bytes > self.bucket_bytes else 0
        return self.pipeline_depth * self.bucket_bytes + merge
