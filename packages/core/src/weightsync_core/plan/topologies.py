"""The cost of each engine topology: a pipeline of per-bucket stages.

A sync is ``B`` buckets pushed through stages (a NIC hop, an intra-host hop, a fan-out over
one uplink, ...). With every stage's time per bucket known, the sync takes

    sum(stages) + (B - 1) * period,   period = max(slowest stage, sum(stages) / depth)

(the first bucket crosses every stage; each later one leaves one period after the previous;
``depth`` buckets in flight cap the overlap). A stage's time is its wire time (latency plus
the copies it carries over its slowest link, divided by the bandwidth) plus the engine's
per-bucket work. The stage that sets the period, or the pipeline fill when that dominates,
is the sync's bound.

Who sends to whom, and where each process runs, come from the cluster's
:class:`~weightsync_core.data.sync_layout.SyncLayout` (:attr:`Cluster.layout`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from weightsync_core.plan.layout import Cluster, Link, Workload

__all__ = [
    "EngineCosts",
    "Prediction",
    "Stage",
    "chained_broadcast",
    "fan_out",
    "pipeline",
    "ring",
    "sharded_delivery",
    "sharded_pull",
]

NCCL_CHUNK_BYTES = 512 << 10
"""Granularity of NCCL's pipelined ring broadcast (its default buffer over its steps)."""


@dataclass(frozen=True)
class EngineCosts:
    """An engine's time beyond the wire, per hop.

    Args:
        per_bucket: CPU seconds per bucket (posting, polling, control messages); stretched
            by CPU contention on a shared-core emulation.
        per_byte: seconds per byte not hidden behind the wire (copies, checksums).
    """

    per_bucket: float = 0.0
    per_byte: float = 0.0

    def bucket_seconds(self, nbytes: float, contention: float = 1.0) -> float:
        """The engine's own time for one bucket of ``nbytes`` on one hop."""
        return self.per_bucket * contention + self.per_byte * nbytes


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: what it is, and its time per bucket."""

    name: str
    seconds: float


@dataclass(frozen=True)
class Prediction:
    """A predicted sync.

    Attributes:
        backend: the weightsync backend.
        option: its topology option, e.g. ``"ring"`` or ``"broadcast, 2 senders"``.
        seconds: predicted sync time (transfer stage).
        bound: what sets it: the slowest stage, the pipeline depth, or the pipeline fill.
        buckets: buckets of the sync.
        stages: every stage with its time per bucket.
    """

    backend: str
    option: str
    seconds: float
    bound: str
    buckets: int
    stages: tuple[Stage, ...]


def pipeline(
    backend: str, option: str, stages: Sequence[Stage], buckets: int, depth: int
) -> Prediction:
    """The sync time of ``buckets`` buckets through ``stages`` with ``depth`` in flight."""
    if not stages:
        raise ValueError("a pipeline needs at least one stage")
    total = sum(stage.seconds for stage in stages)
    slowest = max(stages, key=lambda stage: stage.seconds)
    period = max(slowest.seconds, total / depth)
    steady = (buckets - 1) * period
    if steady < total and len(stages) > 1:
        bound = f"pipeline fill: one bucket through {len(stages)} stages"
    elif slowest.seconds >= total / depth:
        ties = sum(1 for stage in stages if stage.seconds >= slowest.seconds * (1 - 1e-9))
        bound = slowest.name + (f" (and {ties - 1} more as slow)" if ties > 1 else "")
    else:
        bound = f"pipeline depth {depth}: {len(stages)} stages share {depth} bucket buffers"
    return Prediction(backend, option, total + steady, bound, buckets, tuple(stages))


def _copies(count: int) -> str:
    return f"{count} cop{'y' if count == 1 else 'ies'}"


def _hop_link(cluster: Cluster, here: str, there: str) -> Link:
    return cluster.intra_host if here == there else cluster.nic


def ring(
    backend: str, cluster: Cluster, workload: Workload, costs: EngineCosts
) -> Prediction:
    """Ring engines (nixl, mooncake): actor rank 0 -> rollout worker 0 -> 1 -> ...; every
    hop is a stage with its own slots, so hops overlap fully."""
    size = workload.bucket_bytes
    contention = cluster.cpu_contention(cluster.rollout_workers + 1)
    chain = [cluster.actor_host(0)] + [
        cluster.rollout_host(w) for w in range(cluster.rollout_workers)
    ]
    stages = []
    for here, there in pairwise(chain):
        kind = "intra-host hop on " + here if here == there else f"NIC hop {here} -> {there}"
        wire = _hop_link(cluster, here, there).seconds(size)
        stages.append(Stage(kind, wire + costs.bucket_seconds(size, contention)))
    return pipeline(backend, "ring", stages, workload.buckets, len(stages))


def _fan_out_stage(
    cluster: Cluster, size: float, receivers: Sequence[int], costs: EngineCosts,
    contention: float, sender_host: str,
) -> Stage:
    remote = sum(1 for w in receivers if cluster.rollout_host(w) != sender_host)
    local = len(receivers) - remote
    wire = 0.0
    if remote:
        wire += cluster.nic.seconds(size, remote)
    if local:
        wire += cluster.intra_host.seconds(size, local)
    name = (f"{sender_host} NIC uplink ({_copies(remote)} a bucket)" if remote
            else f"intra-host link on {sender_host} ({_copies(local)} a bucket)")
    return Stage(name, wire + costs.bucket_seconds(size, contention))


def fan_out(
    backend: str, cluster: Cluster, workload: Workload, costs: EngineCosts, senders: int = 1,
) -> Prediction:
    """Collective broadcast whose root sends every receiver its own copy (gloo's broadcast,
    Ray's object store): all copies leave actor host 0's one NIC, whatever the number of
    senders (relays sit on that host too)."""
    contention = cluster.cpu_contention(cluster.rollout_workers + senders)
    stage = _fan_out_stage(cluster, workload.bucket_bytes, range(cluster.rollout_workers),
                           costs, contention, cluster.actor_host(0))
    option = "broadcast" + (f", {senders} senders" if senders > 1 else "")
    return pipeline(backend, option, [stage], workload.buckets, workload.pipeline_depth)


def _split(total: int, parts: int) -> list[range]:
    share, extra = divmod(total, parts)
    ranges, start = [], 0
    for part in range(parts):
        size = share + (1 if part < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def chained_broadcast(
    backend: str, cluster: Cluster, workload: Workload, costs: EngineCosts, senders: int = 1,
) -> Prediction:
    """Collective broadcast pipelined along a ring of its members (NCCL, HCCL): each sender's
    group crosses every host boundary once, so a NIC carries one copy per group through it;
    ``senders`` groups (relays on actor host 0) put ``senders`` copies on its uplink. Every
    bucket is a collective of its own, and collectives on one communicator run one after
    another, so every bucket pays the chain's fill (a chunk and a latency a hop). NCCL
    spreads each collective over all ``nics_per_host`` NICs of a host (the other topologies
    send from one process a hop, over one NIC)."""
    size = workload.bucket_bytes
    up: Counter[str] = Counter()
    down: Counter[str] = Counter()
    intra_hops, longest = 0, 0
    for group in _split(cluster.rollout_workers, min(senders, cluster.rollout_workers)):
        chain = [cluster.actor_host(0)] + [cluster.rollout_host(w) for w in group]
        longest = max(longest, len(chain) - 1)
        for here, there in pairwise(chain):
            if here == there:
                intra_hops += 1
            else:
                up[here] += 1
                down[there] += 1
    nic_copies = max([*up.values(), *down.values(), 0])
    # NCCL streams a bucket in chunks: the last chunk trails the first by a chunk a hop.
    chunk = min(NCCL_CHUNK_BYTES, size)
    wire = longest * cluster.nic.latency + (longest - 1) * chunk / cluster.nic.bandwidth
    # the actor host is never a rollout host; NCCL spreads a collective over every NIC of a
    # host (a channel a NIC)
    wire += nic_copies * size / (cluster.nic.bandwidth * cluster.nics_per_host)
    nics = f" over its {cluster.nics_per_host} NICs" if cluster.nics_per_host > 1 else ""
    name = f"NIC of the busiest host ({_copies(nic_copies)} a bucket{nics})"
    if intra_hops:
        wire = max(wire, cluster.intra_host.seconds(size))
    contention = cluster.cpu_contention(cluster.rollout_workers + senders)
    stage = Stage(name, wire + costs.bucket_seconds(size, contention))
    option = "broadcast" + (f", {senders} senders" if senders > 1 else "")
    return pipeline(backend, option, [stage], workload.buckets, workload.pipeline_depth)


def _relay_stage(
    cluster: Cluster, size: float, replica: range, relay: str, contention: float
) -> Stage:
    """The relay of one bucket from the leader of ``replica`` (its rollout ranks: the first
    leads) to the rest of it."""
    leader, members = replica[0], replica[1:]
    leader_host = cluster.rollout_host(leader)
    if relay == "chained":
        spans_hosts = any(cluster.rollout_host(w) != leader_host for w in members)
        link = cluster.nic if spans_hosts else cluster.intra_host
        return Stage("relay inside a replica (chained broadcast)", link.seconds(size))
    stage = _fan_out_stage(cluster, size, members, EngineCosts(), contention, leader_host)
    return Stage(f"relay inside a replica: {stage.name}", stage.seconds)


def sharded_pull(
    backend: str, cluster: Cluster, workload: Workload, costs: EngineCosts,
    relay: str = "fan-out",
) -> Prediction:
    """kimi: every actor rank serves its share; every replica's leader pulls every bucket
    (owners interleaved, all leaders in the same order, so one owner's host serves all
    leaders at once) and relays it to the rest of its replica over a collective broadcast
    (``relay``: ``fan-out`` for gloo, ``chained`` for nccl), overlapping the next pull
    (``pipeline_depth`` slots; kimi has 2). The slowest replica's relay counts."""
    if relay not in ("fan-out", "chained"):
        raise ValueError(f"relay must be 'fan-out' or 'chained', got {relay!r}")
    size = workload.bucket_bytes
    layout = cluster.layout
    contention = cluster.cpu_contention(layout.rollout_world_size + layout.actor_ranks)
    stages = [Stage(
        f"owner's host NIC uplink ({layout.num_replicas} leader(s) pull each bucket)",
        cluster.nic.seconds(size, layout.num_replicas)
        + costs.bucket_seconds(size, contention),
    )]
    replicas = [layout.replica_ranks(index) for index in range(layout.num_replicas)]
    relay_stages = [_relay_stage(cluster, size, ranks, relay, contention)
                    for ranks in replicas if len(ranks) > 1]
    if relay_stages:
        stages.append(max(relay_stages, key=lambda stage: stage.seconds))
    share = math.ceil(workload.model_bytes / layout.actor_ranks)
    buckets = layout.actor_ranks * math.ceil(share / workload.bucket_bytes)
    option = f"pull + {'nccl' if relay == 'chained' else 'gloo'} relay"
    return pipeline(backend, option, stages, buckets, workload.pipeline_depth)


def sharded_delivery(
    backend: str, cluster: Cluster, workload: Workload, costs: EngineCosts,
    replicated_fraction: float = 0.0, relay: bool = False,
) -> Prediction:
    """Sharded delivery: every rollout worker receives only its own shard (its replica's
    workers split the model evenly, as tensor or expert parallelism does, except
    ``replicated_fraction`` of it that every worker needs whole: norms, replicated KV heads),
    from every actor rank at once (each sends the rows it holds: an even share of all
    the bytes). Every process uses a NIC of its host (``nics_per_host``: processes beyond
    that share them), so the busiest NIC, at either end, sets the time: its bytes stream in
    buckets of the workload's size, each paying the engine's per-bucket cost.

    With ``relay``, the actor ranks send each distinct slice once (one model in all) and
    the workers forward the other replicas' copies to each other, each worker an even share
    of them over its NIC's uplink: a second hop, whose bucket adds to the pipeline's fill.
    """
    if not 0.0 <= replicated_fraction <= 1.0:
        raise ValueError(f"replicated_fraction must be within [0, 1], got {replicated_fraction!r}")
    layout = cluster.layout
    workers = cluster.workers_per_replica
    per_worker = workload.model_bytes * ((1 - replicated_fraction) / workers
                                         + replicated_fraction)
    total = per_worker * cluster.rollout_workers
    sent = workload.model_bytes if relay else total
    actor_nics = min(cluster.actor_ranks_per_host, cluster.nics_per_host)
    rollout_nics = min(cluster.rollout_workers_per_host, cluster.nics_per_host)
    uplink = sent / cluster.actor_ranks * cluster.actor_ranks_per_host / actor_nics
    downlink = per_worker * cluster.rollout_workers_per_host / rollout_nics
    relayed = (total - sent) / cluster.rollout_workers * cluster.rollout_workers_per_host \
        / rollout_nics
    busiest, name = max((uplink, f"actor host NIC uplinks ({uplink / 1e9:.3g} GB each)"),
                        (downlink, f"rollout host NIC downlinks ({downlink / 1e9:.3g} GB each)"),
                        (relayed, f"rollout host NIC uplinks, relaying ({relayed / 1e9:.3g} "
                                  "GB each)"))
    buckets = max(1, math.ceil(busiest / workload.bucket_bytes))
    size = busiest / buckets
    contention = cluster.cpu_contention(layout.rollout_world_size + layout.actor_ranks)
    stages = [Stage(name, cluster.nic.seconds(size) + costs.bucket_seconds(size, contention))]
    if relay:
        hop = relayed / buckets
        stages.append(Stage("relay hop between replicas",
                            cluster.nic.seconds(hop) + costs.bucket_seconds(hop, contention)))
    option = "sharded delivery" + (", relayed between replicas" if relay else "")
    return pipeline(backend, option, stages, buckets, workload.pipeline_depth)
