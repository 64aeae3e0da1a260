"""Sharded delivery on the testbed: ``A`` actor hosts (one rank each, holding its FSDP-style
rows) into replicas of ``TP`` workers, every process on a host of its own with one shaped
NIC, against the full-copy topologies on the same weights, in one run, each cell beside what
core's planner (``weightsync plan --sharded``) predicts from the links probed at the start.

Workers of a replica split every tensor by rows, as a tensor-parallel worker needs about
1/TP of most tensors; the full-copy engines deliver every tensor whole to every worker. The
sharded engines relay between replicas (the workers that need the same rows forward them to
each other); ``backend+direct`` measures one without relays. ``backend+delta`` measures
delta syncs (``delta=True``): after a full sync, each timed sync changes about
``changed_fraction`` of every tensor's elements on every actor rank, and moves patches (a
sharded backend's: patches of each piece, against each worker's copy of its slices).
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
from weightsync_core.plan.moe import delta_wire_fraction
from weightsync_testbed.bench import DEFAULT_ENGINE_KWARGS
from weightsync_testbed.network import Link as ShapedLink
from weightsync_testbed.network import NicBytes
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
    diff_seconds: float | None = None
    """A delta sync's seconds spent diffing, summed over the sending ranks (median)."""
    apply_seconds: float | None = None
    """A delta sync's longest time any worker spent applying patches (median)."""

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
    changed_fraction: float = 0.0
    """What each delta sync (``+delta`` methods) changed of every tensor."""
    probed_bits_per_second: float = 0.0
    probed_latency_seconds: float = 0.0
    cpu_cores: int = 0
    cells: list[ShardedCell] = field(default_factory=list)

    def markdown(self) -> str:
        """A table per layout: each method's time, its prediction, the sharded
        engines' speed-up over the fastest full-copy method measured (of the same kind: full
        or delta syncs) and each delta method's over the same method's full syncs."""
        lines = [f"{self.nbytes / 2**20:.0f} MiB of float32 weights, every process on a host "
                 f"of its own, links {self.link} (probed "
                 f"{self.probed_bits_per_second / 1e9:.3f} Gbit/s, "
                 f"{self.probed_latency_seconds * 1e6:.0f} us), {self.bucket_megabytes} MiB "
                 f"buckets, median of {self.repeats}"
                 + (f"; delta syncs change {self.changed_fraction:.0%} of every tensor"
                    if any(_method(cell.method, 0)[3] for cell in self.cells) else ""), "",
                 "| layout | method | weightsync/bytes | measured | predicted (error) | bound "
                 "| speed-up over the best full copy | over the same without delta | diff; "
                 "apply | NIC MiB per sync, busiest / mean: actor uplinks; worker downlinks; "
                 "worker uplinks | CPU busy |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for layout in dict.fromkeys(cell.layout for cell in self.cells):
            cells = [cell for cell in self.cells if cell.layout == layout]
            seconds = {cell.method: cell.seconds for cell in cells}
            for cell in cells:
                predicted = ("-" if cell.predicted is None else
                             f"{cell.predicted:.2f} s ({cell.prediction_error:+.0%})")
                delta = _method(cell.method, 0)[3]
                full = [other.seconds for other in cells if not is_sharded(other.method)
                        and _method(other.method, 0)[3] == delta]
                ratio = (f"{min(full) / cell.seconds:.2f}x" if full
                         and is_sharded(cell.method) else "")
                plain = seconds.get(cell.method.replace("+delta", ""))
                over_full = f"{plain / cell.seconds:.2f}x" if delta and plain else ""
                costs = ("" if cell.diff_seconds is None else
                         f"{cell.diff_seconds:.2f} s; {cell.apply_seconds or 0.0:.2f} s")
                busy = "-" if cell.cpu_busy is None else f"{cell.cpu_busy:.0%}"
                lines.append(f"| {layout} | {cell.method} | {cell.worker_bytes / 2**20:.1f} MiB "
                             f"| {cell.seconds:.2f} s | {predicted} | {cell.bound or '-'} "
                             f"| {ratio} | {over_full} | {costs} | {cell.nic_spread()} "
                             f"| {busy} |")
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
    changed_fraction: float = 0.02,
) -> ShardedReport:
    """Start one testbed with hosts for the largest of ``layouts`` (``(actor hosts, TP)``
    each: ``replicas`` replicas of ``TP`` workers), measure every method on every layout,
    tear it down; returns the cells. A method is a backend, ``backend:MiB`` for buckets of
    that size (default ``bucket_megabytes``), a sharded backend with ``+direct`` for
    its delivery without relays between replicas, and any with ``+delta`` for its delta
    syncs of ``changed_fraction`` changed."""
    link = link or ShapedLink("1gbit")
    if link.bits_per_second is None:
        raise ValueError("the sharded benchmark needs shaped links (a rate, e.g. '1gbit')")
    actor_hosts = [f"a{i}" for i in range(max(actors for actors, _ in layouts))]
    worker_hosts = [f"w{i}" for i in range(replicas * max(tp for _, tp in layouts))]
    nbytes = size_megabytes << 20
    report = ShardedReport(link.rate or "", nbytes, bucket_megabytes, repeats,
                           changed_fraction, cpu_cores=len(os.sched_getaffinity(0)))
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
                backend, bucket, relay, delta = _method(method, bucket_megabytes)
                fraction = changed_fraction if delta else None
                cell = measure_cell(testbed, backend, actors, tp, replicas, placement, nbytes,
                                    bucket, repeats, relay, fraction)
                cell.method = method
                moved = nbytes if fraction is None else max(1, round(
                    nbytes * delta_wire_fraction(fraction, bytes_per_element=4)))
                prediction = _predict(backend, cluster, Workload(moved, bucket << 20), relay)
                cell.predicted, cell.bound = prediction.seconds, prediction.bound
                report.cells.append(cell)
                print(f"  {cell.layout}, {method}: {cell.seconds:.2f} s (predicted "
                      f"{cell.predicted:.2f} s), {cell.worker_bytes / 2**20:.0f} MiB per "
                      "worker", flush=True)
    return report


def is_sharded(method: str) -> bool:
    """Whether ``method`` (``backend[:MiB][+direct][+delta]``) is a sharded backend's."""
    return _method(method, 0)[0].endswith("_sharded")


def _method(method: str, bucket_megabytes: int) -> tuple[str, int, bool, bool]:
    """``backend[:MiB][+direct][+delta]``: the backend, its bucket size (default
    ``bucket_megabytes``), whether it relays between replicas (not with ``+direct``) and
    whether it moves delta syncs (``+delta``).

    Raises:
        ValueError: ``+direct`` on a backend that is not sharded, or another mode.
    """
    name, *modes = method.split("+")
    backend, _, bucket = name.partition(":")
    for mode in modes:
        if mode not in ("direct", "delta"):
            raise ValueError(f"method {method}: no mode {mode!r} (modes: '+direct', "
                             "'+delta')")
        if mode == "direct" and not backend.endswith("_sharded"):
            raise ValueError(f"method {method}: only a sharded backend takes '+direct'")
    return (backend, int(bucket) if bucket else bucket_megabytes, "direct" not in modes,
            "delta" in modes)


def _predict(method: str, cluster: Cluster, workload: Workload, relay: bool) -> Prediction:
    if method.endswith("_sharded"):
        return sharded_plan(cluster, workload, relay=relay and cluster.replicas > 1)
    return plan(cluster, workload, backends=[method])[0].prediction


def measure_cell(testbed: Testbed, method: str, actors: int, tp: int, replicas: int,
                 placement: SpreadPlacement, nbytes: int, bucket_megabytes: int,
                 repeats: int, relay: bool = True, changed_fraction: float | None = None
                 ) -> ShardedCell:
    """``method`` (a backend) from ``actors`` ranks holding FSDP rows of ``nbytes`` of
    weights into ``replicas`` replicas of ``tp`` workers, placed on ``testbed``'s hosts by
    ``placement`` (sharded backends: each worker needs its tensor-parallel rows, relayed
    between replicas unless ``relay`` is False; others deliver every tensor whole): the
    median transfer seconds of ``repeats`` syncs after a warm-up, the bytes moved
    (``weightsync/bytes``: per worker, the busiest's where sharded; a delta sync's, what
    the senders sent), and what every host's NIC carried per sync. With
    ``changed_fraction``, delta syncs: each timed sync changes that fraction of every
    tensor on every actor rank first (not timed)."""
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
        delta = changed_fraction is not None
        manager = deployment.manager(delta=delta)
        # warm-up: connections, registrations, and a delta sync's baseline
        manager.update_weights_sync(global_steps=0)
        hosts = [*placement.actors, *placement.workers]
        received: list[float] = []
        carried = {host: NicBytes(0, 0) for host in hosts}  # by the timed syncs only

        def measure(step: int) -> dict[str, float]:
            if changed_fraction is not None:
                ray.get([actor.change_elements.remote(changed_fraction, step)
                         for actor in deployment.actors])
            before = {host: testbed.nic_bytes(host) for host in hosts}
            metrics = manager.update_weights_sync(global_steps=step)
            for host in hosts:
                carried[host] += testbed.nic_bytes(host) - before[host]
            received.append(metrics["weightsync/bytes"])
            return {"transfer": metrics["weightsync/seconds/transfer"],
                    "diff": metrics.get("weightsync/seconds/diff", 0.0),
                    "apply": metrics.get("weightsync/seconds/apply", 0.0)}

        cpu_before = _cpu_jiffies()
        medians = median_seconds([measure], repeats, warm_up=False)
        seconds = medians["transfer"]
        cpu_after = _cpu_jiffies()
        # a full copy's bytes are what one worker receives; a sharded sync's, the busiest
        # worker's
        worker_bytes = int(received[-1])
    time.sleep(1)  # let the killed processes release their ports
    syncs = len(received)
    return ShardedCell(actors, tp, replicas, method, seconds, worker_bytes,
                       [carried[host].sent // syncs for host in placement.actors],
                       [carried[host].received // syncs for host in placement.workers],
                       [carried[host].sent // syncs for host in placement.workers],
                       _busy_fraction(cpu_before, cpu_after),
                       diff_seconds=medians["diff"] if delta else None,
                       apply_seconds=medians["apply"] if delta else None)


def _cpu_jiffies() -> tuple[int, int]:
    """The machine's busy and total CPU time so far (``/proc/stat``, all cores)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return sum(fields) - idle, sum(fields)


def _busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total else None
