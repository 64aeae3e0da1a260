"""The testbed benchmark: one actor host syncing to 1, 2 and 4 replica hosts over shaped
links, for each backend, beside the raw transports and the Ray object store, in one run.

Every cell reports time, the fraction of line rate (payload bytes / link rate / time; the
actor host's uplink and every receiver's downlink run at the link rate) and the scaling from
1 receiver to N, beside what the method's topology predicts:

- ring engines (nixl, mooncake) forward each of B buckets hop by hop, pipelined: N hops take
  B + N - 1 bucket times where one takes B, so (B + N - 1) / B;
- ``gloo``'s broadcast, ``kimi``'s pulls from the one actor rank, and the Ray object store
  (every receiver pulls from the owner at once) leave the actor host's one uplink carrying a
  copy per receiver: N.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray

from weightsync_core.benchmark import RawBroadcastPeer
from weightsync_core.config import CheckpointEngineConfig
from weightsync_core.registry import BackendState, CheckpointEngineRegistry
from weightsync_core.ring_benchmark import RawTransferPeer
from weightsync_core.testing import SyncHarness
from weightsync_testbed.network import Link
from weightsync_testbed.placement import HostPlacement, on_host
from weightsync_testbed.testbed import Testbed

__all__ = ["BenchCell", "BenchReport", "run_testbed_bench"]

DEFAULT_ENGINE_KWARGS: dict[str, dict[str, Any]] = {
    "gloo": {},
    "nixl": {"device": "cpu", "ucx_transports": "tcp"},
    "mooncake": {"protocol": "tcp"},
    "kimi": {"protocol": "tcp", "collective": "gloo"},
}
"""CPU settings of each backend on the testbed (TCP everywhere)."""

_ACTOR_HOST = "a0"


def predicted_scaling(method: str, receivers: int, buckets: int) -> float:
    """Time to ``receivers`` hosts over time to one, as the method's topology predicts
    (see the module docstring); ``buckets`` is the number of buckets of a sync."""
    if method in ("nixl", "mooncake"):
        return (buckets + receivers - 1) / buckets
    return float(receivers)


@dataclass
class BenchCell:
    """One method at one number of receiver hosts."""

    method: str
    receivers: int
    seconds: float
    nbytes: int
    link_bits_per_second: float

    @property
    def line_rate_fraction(self) -> float:
        """Payload bytes / link rate / time."""
        return self.nbytes * 8 / self.link_bits_per_second / self.seconds


@dataclass
class BenchReport:
    """The whole matrix."""

    link: str
    nbytes: int
    bucket_megabytes: int
    repeats: int
    cells: list[BenchCell] = field(default_factory=list)

    @property
    def buckets(self) -> int:
        """Buckets of one sync."""
        return -(-self.nbytes // (self.bucket_megabytes << 20))

    def cell(self, method: str, receivers: int) -> BenchCell | None:
        """The cell of ``method`` at ``receivers`` hosts, if measured."""
        return next((c for c in self.cells
                     if c.method == method and c.receivers == receivers), None)

    def methods(self) -> list[str]:
        """Methods in the order they were measured."""
        return list(dict.fromkeys(c.method for c in self.cells))

    def markdown(self) -> str:
        """The table: time, fraction of line rate, scaling against 1 receiver and what the
        topology predicts."""
        counts = sorted({c.receivers for c in self.cells})
        head = (f"{self.nbytes / 2**20:.0f} MiB from 1 actor host to N replica hosts, links "
                f"{self.link} full duplex, {self.bucket_megabytes} MiB buckets, median of "
                f"{self.repeats}")
        lines = [head, "",
                 "| method | " + " | ".join(f"{n} host{'s' if n > 1 else ''}" for n in counts)
                 + f" | {counts[-1]} vs 1: measured (topology predicts) |",
                 "| --- |" + " --- |" * (len(counts) + 1)]
        for method in self.methods():
            row = [f"| {method} "]
            for n in counts:
                cell = self.cell(method, n)
                row.append(f"| {cell.seconds:.2f} s, {cell.line_rate_fraction:.2f} of line "
                           if cell else "| - ")
            one, many = self.cell(method, counts[0]), self.cell(method, counts[-1])
            if one and many and many is not one:
                predicted = predicted_scaling(method, counts[-1], self.buckets)
                row.append(f"| {many.seconds / one.seconds:.2f}x ({predicted:.2f}x) |")
            else:
                row.append("| - |")
            lines.append("".join(row))
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """Plain data, with each cell's fraction of line rate."""
        data = asdict(self)
        for cell, raw in zip(self.cells, data["cells"], strict=True):
            raw["line_rate_fraction"] = cell.line_rate_fraction
        return data

    def chart(self, path: Path) -> None:
        """A PNG: fraction of line rate per method and number of receiver hosts."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        counts = sorted({c.receivers for c in self.cells})
        methods = self.methods()
        width = 0.8 / len(counts)
        figure, axes = plt.subplots(figsize=(1.6 * len(methods) + 2, 4))
        for offset, n in enumerate(counts):
            values = [(self.cell(m, n).line_rate_fraction if self.cell(m, n) else 0.0)
                      for m in methods]
            axes.bar([i + offset * width for i in range(len(methods))], values, width,
                     label=f"{n} receiver host{'s' if n > 1 else ''}")
        axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        axes.set_xticks([i + width * (len(counts) - 1) / 2 for i in range(len(methods))],
                        methods, rotation=15)
        axes.set_ylabel("fraction of line rate")
        axes.set_title(f"{self.nbytes / 2**20:.0f} MiB over {self.link} links")
        axes.legend()
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)


class _ObjectStoreHolder:
    """Owns one object per round on the actor host."""

    def put(self, nbytes: int) -> list[ray.ObjectRef]:
        return [ray.put(np.full(nbytes, 7, dtype=np.uint8))]


class _ObjectStoreReader:
    """Pulls an object to its own host."""

    def fetch(self, wrapped: list[ray.ObjectRef]) -> int:
        array = ray.get(wrapped[0])
        return int(array[-1]) * len(array)


def _engine_cells(
    backend: str, kwargs: dict[str, Any], counts: list[int], nbytes: int, bucket_mb: int,
    repeats: int, replica_hosts: list[str], rate: float,
) -> list[BenchCell]:
    config = CheckpointEngineConfig(
        backend=backend, update_weights_bucket_megabytes=bucket_mb,
        engine_kwargs={backend: dict(kwargs)}, sync_timeout_seconds=600,
    )
    placement = HostPlacement([_ACTOR_HOST], replica_hosts)
    harness = SyncHarness(config, 1, (1,) * max(counts), placement=placement)
    try:
        sent = ray.get(harness.actors[0].set_uniform_weights.remote(nbytes, 64))
        workers = harness.workers(harness.replicas)[1:]
        ray.get([worker.set_faults.remote(discard=True) for worker in workers])
        managers = {n: harness.manager(harness.replicas[:n]) for n in counts}
        for manager in managers.values():  # warm-up: connections, buffers, page faults
            manager.update_weights_sync(0)
        times: dict[int, list[float]] = {n: [] for n in counts}
        for step in range(1, repeats + 1):
            for n, manager in managers.items():
                metrics = manager.update_weights_sync(step)
                times[n].append(metrics["weightsync/seconds/transfer"])
    finally:
        harness.shutdown()
    return [BenchCell(backend, n, statistics.median(times[n]), sent, rate) for n in counts]


def _raw_write_cell(
    backend: str, kwargs: dict[str, Any], nbytes: int, repeats: int, rate: float
) -> BenchCell:
    config = CheckpointEngineConfig(backend=backend, engine_kwargs={backend: dict(kwargs)})
    peer = ray.remote(RawTransferPeer)
    writer = peer.options(num_cpus=0, **on_host(_ACTOR_HOST)).remote(config, nbytes, 1)
    reader = peer.options(num_cpus=0, **on_host("r0")).remote(config, nbytes, 0)
    try:
        target = ray.get(reader.address.remote())
        ray.get(writer.write_to.remote(target))  # warm-up
        if ray.get(reader.checksum.remote()) != nbytes:
            raise RuntimeError(f"the raw {backend} write did not deliver the buffer")
        seconds = [ray.get(writer.write_to.remote(target)) for _ in range(repeats)]
    finally:
        for handle in (writer, reader):
            ray.kill(handle)
    return BenchCell(f"raw {backend} write", 1, statistics.median(seconds), nbytes, rate)


def _raw_broadcast_cells(
    counts: list[int], nbytes: int, repeats: int, replica_hosts: list[str], rate: float
) -> list[BenchCell]:
    cells = []
    peer = ray.remote(RawBroadcastPeer)
    for n in counts:
        hosts = [_ACTOR_HOST, *replica_hosts[:n]]
        peers = [peer.options(num_cpus=0, **on_host(host)).remote() for host in hosts]
        try:
            master = ray.get(peers[0].prepare.remote())
            ray.get([p.prepare.remote() for p in peers[1:]])
            ray.get([p.setup.remote(rank, len(peers), master, nbytes)
                     for rank, p in enumerate(peers)])
            ray.get([p.broadcast.remote() for p in peers])  # warm-up
            seconds = [max(ray.get([p.broadcast.remote() for p in peers]))
                       for _ in range(repeats)]
        finally:
            for handle in peers:
                ray.kill(handle)
        cells.append(BenchCell("raw gloo broadcast", n, statistics.median(seconds), nbytes, rate))
    return cells


def _object_store_cells(
    counts: list[int], nbytes: int, repeats: int, replica_hosts: list[str], rate: float
) -> list[BenchCell]:
    holder = ray.remote(_ObjectStoreHolder).options(num_cpus=0, **on_host(_ACTOR_HOST)).remote()
    reader = ray.remote(_ObjectStoreReader)
    readers = [reader.options(num_cpus=0, **on_host(host)).remote()
               for host in replica_hosts[: max(counts)]]
    cells = []
    try:
        for n in counts:
            seconds = []
            for _ in range(repeats + 1):  # the first round warms up
                wrapped = ray.get(holder.put.remote(nbytes))  # a new object every round
                start = time.perf_counter()
                got = ray.get([r.fetch.remote(wrapped) for r in readers[:n]])
                seconds.append(time.perf_counter() - start)
                if got != [7 * nbytes] * n:
                    raise RuntimeError("the object store delivered wrong bytes")
                del wrapped
            median = statistics.median(seconds[1:])
            cells.append(BenchCell("Ray object store", n, median, nbytes, rate))
    finally:
        for handle in (holder, *readers):
            ray.kill(handle)
    return cells


def run_testbed_bench(
    backends: list[str] | None = None,
    size_megabytes: int = 256,
    receivers: tuple[int, ...] = (1, 2, 4),
    link: Link | None = None,
    bucket_megabytes: int = 64,
    repeats: int = 3,
) -> BenchReport:
    """Start a testbed (an actor host and ``max(receivers)`` replica hosts), measure every
    backend and the baselines on it, tear it down; returns the matrix."""
    link = link or Link("1gbit")
    rate = link.bits_per_second
    if rate is None:
        raise ValueError("the testbed benchmark needs shaped links (a rate, e.g. '1gbit')")
    if not backends:
        known = CheckpointEngineRegistry.available(probe=False)
        backends = [name for name in DEFAULT_ENGINE_KWARGS if name in known
                    and known[name].state in (BackendState.INSTALLED, BackendState.LOADED)]
    counts = sorted(set(receivers))
    replica_hosts = [f"r{i}" for i in range(max(counts))]
    nbytes = size_megabytes << 20
    report = BenchReport(link.rate or "", nbytes, bucket_megabytes, repeats)
    with Testbed(hosts=[_ACTOR_HOST, *replica_hosts], link=link, prefix="wstb"):
        for backend in backends:
            kwargs = DEFAULT_ENGINE_KWARGS.get(backend, {})
            _add(report, _engine_cells(backend, kwargs, counts, nbytes, bucket_megabytes,
                                       repeats, replica_hosts, rate))
            if backend in ("nixl", "mooncake"):
                _add(report, [_raw_write_cell(backend, kwargs, nbytes, repeats, rate)])
        _add(report, _raw_broadcast_cells(counts, nbytes, repeats, replica_hosts, rate))
        _add(report, _object_store_cells(counts, nbytes, repeats, replica_hosts, rate))
    return report


def _add(report: BenchReport, cells: list[BenchCell]) -> None:
    """Record ``cells`` and say so (a matrix takes minutes)."""
    report.cells += cells
    for cell in cells:
        print(f"  {cell.method}, {cell.receivers} receiver host(s): {cell.seconds:.2f} s, "
              f"{cell.line_rate_fraction:.2f} of line rate", flush=True)
