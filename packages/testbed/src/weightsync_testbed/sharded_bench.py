"""Sharded delivery on the testbed: ``A`` actor hosts (one rank each, holding its FSDP-style
rows) into replicas of ``TP`` workers, every process on a host of its own with one shaped
NIC, against the full-copy topologies on the same weights, in one run, each cell beside what
core's planner (``weightsync plan --sharded``) predicts from the links probed at the start.

Workers of a replica split every tensor by rows, as a tensor-parallel worker needs about
1/TP of most tensors; the full-copy engines deliver every tensor whole to every worker. The
sharded engines relay between replicas (the workers that need the same rows forward them to
each other); ``backend+direct`` measures one without relays.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

from weightsync_core.bench.measure import bench_config, median_seconds, synthetic_deployment
from weightsync_core.data.shards import fsdp_spec
from weightsync_core.plan import Cluster, Prediction, Workload, measure_link, plan, sharded_plan
from weightsync_testbed.bench import DEFAULT_ENGINE_KWARGS
from weightsync_testbed.network import Link as ShapedLink
from weightsync_testbed.placement import SpreadPlacement, on_host
from weightsync_testbed.testbed import Testbed

__all__ = [
    "SHARDED_ENGINE_KWARGS",
    "ShardedCell",
    "ShardedReport",
    "is_sharded",
    "measure_cell",
    "run_sharded_bench",
]

SHARDED_ENGINE_KWARGS: dict[str, dict[str, Any]] = {
    "nixl_sharded": {"ucx_transports": "tcp"},
    "mooncake_sharded": {"protocol": "tcp"},
    "gloo_sharded": {},
}
"""CPU settings of each sharded backend on the testbed (TCP everywhere)."""

_TENSORS = 64


@dataclass
class ShardedCell:
    """One method on one layout."""

    actor_hosts: int
    tp: int
    replicas: int
    method: str
    seconds: float
    worker_bytes: int
    """Bytes each rollout worker received."""
    actor_nic_sent: list[int] = field(default_factory=list)
    """Bytes each actor host's NIC sent per sync (Ethernet frames, control traffic
    included)."""
    worker_nic_received: list[int] = field(default_factory=list)
    """Bytes each worker host's NIC received per sync."""
    worker_nic_sent: list[int] = field(default_factory=list)
    """Bytes each worker host's NIC sent per sync (relays)."""
    cpu_busy: float | None = None
    """The machine's CPU time busy during the timed syncs, as a fraction of all its cores'
    (every emulated host shares them)."""
    predicted: float | None = None
    bound: str | None = None

    @property
    def layout(self) -> str:
        """``2 actor hosts -> 2 x TP=2``."""
        return f"{self.actor_hosts} actor hosts -> {self.replicas} x TP={self.tp}"

    def nic_spread(self) -> str:
        """The busiest actor uplink, worker downlink and worker uplink against the mean of
        their kind (MiB per sync): how evenly the bytes spread."""
        def spread(counts: list[int]) -> str:
            if not counts:
                return "-"
            return f"{max(counts) / 2**20:.0f} / {sum(counts) / len(counts) / 2**20:.0f}"

        return (f"{spread(self.actor_nic_sent)}; {spread(self.worker_nic_received)}; "
                f"{spread(self.worker_nic_sent)}")

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured."""
        return None if self.predicted is None else self.predicted / self.seconds - 1


@dataclass
class ShardedReport:
    """Every layout's cells, with the probed link."""

    link: str
    nbytes: int
    bucket_megabytes: int
    repeats: int
    probed_bits_per_second: float = 0.0
    probed_latency_seconds: float = 0.0
    cpu_cores: int = 0
    cells: list[ShardedCell] = field(default_factory=list)

    def markdown(self) -> str:
        """A table per layout: each method's time, its prediction, and the sharded
        engines' speed-up over the fastest full-copy method measured."""
        lines = [f"{self.nbytes / 2**20:.0f} MiB of float32 weights, every process on a host "
                 f"of its own, links {self.link} (probed "
                 f"{self.probed_bits_per_second / 1e9:.3f} Gbit/s, "
                 f"{self.probed_latency_seconds * 1e6:.0f} us), {self.bucket_megabytes} MiB "
                 f"buckets, median of {self.repeats}", "",
                 "| layout | method | bytes per worker | measured | predicted (error) | bound "
                 "| speed-up over the best full copy | NIC MiB per sync, busiest / mean: "
                 "actor uplinks; worker downlinks; worker uplinks | CPU busy |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for layout in dict.fromkeys(cell.layout for cell in self.cells):
            cells = [cell for cell in self.cells if cell.layout == layout]
            full = [cell.seconds for cell in cells if not is_sharded(cell.method)]
            best = min(full) if full else None
            for cell in cells:
                predicted = ("-" if cell.predicted is None else
                             f"{cell.predicted:.2f} s ({cell.prediction_error:+.0%})")
                ratio = (f"{best / cell.seconds:.2f}x" if best is not None
                         and is_sharded(cell.method) else "")
                busy = "-" if cell.cpu_busy is None else f"{cell.cpu_busy:.0%}"
                lines.append(f"| {layout} | {cell.method} | {cell.worker_bytes / 2**20:.0f} MiB "
                             f"| {cell.seconds:.2f} s | {predicted} | {cell.bound or '-'} "
                             f"| {ratio} | {cell.nic_spread()} | {busy} |")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """Plain data."""
        return asdict(self)


def run_sharded_bench(
    layouts: Sequence[tuple[int, int]] = ((2, 2), (4, 4)),
    size_megabytes: int = 256,
    link: ShapedLink | None = None,
    bucket_megabytes: int = 64,
    repeats: int = 3,
    sharded: Sequence[str] = ("nixl_sharded",),
    full_copy: Sequence[str] = ("mooncake", "mooncake:8", "nixl", "gloo"),
    replicas: int = 2,
) -> ShardedReport:
    """Start one testbed with hosts for the largest of ``layouts`` (``(actor hosts, TP)``
    each: ``replicas`` replicas of ``TP`` workers), measure every method on every layout,
    tear it down; returns the cells. A method is a backend, ``backend:MiB`` for buckets of
    that size (default ``bucket_megabytes``), or a sharded backend with ``+direct`` for
    its delivery without relays between replicas."""
    link = link or ShapedLink("1gbit")
    if link.bits_per_second is None:
        raise ValueError("the sharded benchmark needs shaped links (a rate, e.g. '1gbit')")
    actor_hosts = [f"a{i}" for i in range(max(actors for actors, _ in layouts))]
    worker_hosts = [f"w{i}" for i in range(replicas * max(tp for _, tp in layouts))]
    nbytes = size_megabytes << 20
    report = ShardedReport(link.rate or "", nbytes, bucket_megabytes, repeats,
                           cpu_cores=len(os.sched_getaffinity(0)))
    with Testbed(hosts=[*actor_hosts, *worker_hosts], link=link, prefix="wsts") as testbed:
        nic = measure_link(on_host(actor_hosts[0]), on_host(worker_hosts[0]))
        intra = measure_link(on_host(worker_hosts[0]), on_host(worker_hosts[0]))
        report.probed_bits_per_second = nic.bandwidth * 8
        report.probed_latency_seconds = nic.latency
        for actors, tp in layouts:
            cluster = Cluster(nic, intra, actor_hosts=actors, replicas=replicas,
                              workers_per_replica=tp, shared_cpu_cores=report.cpu_cores)
            placement = SpreadPlacement(actor_hosts[:actors], worker_hosts[:replicas * tp], tp)
            for method in [*full_copy, *sharded]:
                backend, bucket, relay = _method(method, bucket_megabytes)
                cell = measure_cell(testbed, backend, actors, tp, replicas, placement, nbytes,
                                    bucket, repeats, relay)
                cell.method = method
                prediction = _predict(backend, cluster, Workload(nbytes, bucket << 20), relay)
                cell.predicted, cell.bound = prediction.seconds, prediction.bound
                report.cells.append(cell)
                print(f"  {cell.layout}, {method}: {cell.seconds:.2f} s (predicted "
                      f"{cell.predicted:.2f} s), {cell.worker_bytes / 2**20:.0f} MiB per "
                      "worker", flush=True)
    return report


def is_sharded(method: str) -> bool:
    """Whether ``method`` (``backend[:MiB][+direct]``) is a sharded backend's."""
    return _method(method, 0)[0].endswith("_sharded")


def _method(method: str, bucket_megabytes: int) -> tuple[str, int, bool]:
    """``backend[:MiB][+direct]``: the backend, its bucket size (default
    ``bucket_megabytes``) and whether it relays between replicas (not with ``+direct``).

    Raises:
        ValueError: ``+direct`` on a backend that is not sharded.
    """
    method, plus, mode = method.partition("+")
    backend, _, bucket = method.partition(":")
    if plus and (mode != "direct" or not backend.endswith("_sharded")):
        raise ValueError(f"method {method}+{mode}: only a sharded backend takes '+direct'")
    return backend, int(bucket) if bucket else bucket_megabytes, not plus


def _predict(method: str, cluster: Cluster, workload: Workload, relay: bool) -> Prediction:
    if method.endswith("_sharded"):
        return sharded_plan(cluster, workload, relay=relay and cluster.replicas > 1)
    return plan(cluster, workload, backends=[method])[0].prediction


def measure_cell(testbed: Testbed, method: str, actors: int, tp: int, replicas: int,
                 placement: SpreadPlacement, nbytes: int, bucket_megabytes: int,
                 repeats: int, relay: bool = True) -> ShardedCell:
    """``method`` (a backend) from ``actors`` ranks holding FSDP rows of ``nbytes`` of
    weights into ``replicas`` replicas of ``tp`` workers, placed on ``testbed``'s hosts by
    ``placement`` (sharded backends: each worker needs its tensor-parallel rows, relayed
    between replicas unless ``relay`` is False; others deliver every tensor whole): the
    median transfer seconds of ``repeats`` syncs after a warm-up, the bytes per worker, and
    what every host's NIC carried per sync."""
    sharded = method.endswith("_sharded")
    kwargs = (SHARDED_ENGINE_KWARGS if sharded else DEFAULT_ENGINE_KWARGS).get(method, {})
    if sharded and not relay:
        kwargs = {**kwargs, "relay": False}
    config = bench_config(method, kwargs, bucket_megabytes)
    with synthetic_deployment(config, actors, (tp,) * replicas, nbytes, _TENSORS,
                              placement) as (deployment, _):
        if sharded:
            ray.get([actor.set_layout.remote(fsdp_spec(actors, rank))
                     for rank, actor in enumerate(deployment.actors)])
            ray.get([worker.set_layout.remote(fsdp_spec(tp, rank))
                     for replica in deployment.replicas
                     for rank, worker in enumerate(replica.workers)])
        manager = deployment.manager()
        manager.update_weights_sync(global_steps=0)  # warm-up: connections, registrations
        hosts = [*placement.actors, *placement.workers]
        before = {host: testbed.nic_bytes(host) for host in hosts}
        received: list[float] = []

        def measure(step: int) -> dict[str, float]:
            metrics = manager.update_weights_sync(global_steps=step)
            received.append(metrics["weightsync/bytes"])
            return {"transfer": metrics["weightsync/seconds/transfer"]}

        cpu_before = _cpu_jiffies()
        seconds = median_seconds([measure], repeats, warm_up=False)["transfer"]
        cpu_after = _cpu_jiffies()
        carried = {host: testbed.nic_bytes(host) - before[host] for host in hosts}
        # a full copy's bytes are what one worker receives; a sharded sync's, the busiest
        # worker's
        worker_bytes = int(received[-1])
    time.sleep(1)  # let the killed processes release their ports
    syncs = len(received)
    return ShardedCell(actors, tp, replicas, method, seconds, worker_bytes,
                       [carried[host].sent // syncs for host in placement.actors],
                       [carried[host].received // syncs for host in placement.workers],
                       [carried[host].sent // syncs for host in placement.workers],
                       _busy_fraction(cpu_before, cpu_after))


def _cpu_jiffies() -> tuple[int, int]:
    """The machine's busy and total CPU time so far (``/proc/stat``, all cores)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return sum(fields) - idle, sum(fields)


def _busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total else None
