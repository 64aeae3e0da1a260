"""The testbed benchmark: one actor host syncing to 1 to 4 replica hosts over shaped
links, for each backend, beside the raw transports and the Ray object store, in one run.

Every cell reports time and the fraction of line rate (payload bytes / link rate / time; the
actor host's uplink and every receiver's downlink run at the link rate), beside what core's
cost model (``weightsync plan``) predicts from link figures probed on the testbed at the
start of the run (:mod:`weightsync_testbed.prediction`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import ray
from ray.actor import ActorHandle

from weightsync_core import BackendState, CheckpointEngineConfig, CheckpointEngineRegistry
from weightsync_core.bench.gloo import raw_broadcast_group, raw_broadcasts
from weightsync_core.bench.measure import (
    bench_config,
    median_seconds,
    sync_seconds,
    synthetic_deployment,
)
from weightsync_core.bench.ring import raw_writes
from weightsync_core.plan import EngineCosts, Link, measure_link
from weightsync_testbed.network import Link as ShapedLink
from weightsync_testbed.placement import HostPlacement, on_host
from weightsync_testbed.prediction import CellModel
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


@dataclass
class BenchCell:
    """One method at one number of receiver hosts."""

    method: str
    receivers: int
    seconds: float
    nbytes: int
    link_bits_per_second: float
    predicted: float | None = None
    bound: str | None = None

    @property
    def line_rate_fraction(self) -> float:
        """Payload bytes / link rate / time."""
        return self.nbytes * 8 / self.link_bits_per_second / self.seconds

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured."""
        return None if self.predicted is None else self.predicted / self.seconds - 1


@dataclass
class BenchReport:
    """The whole matrix."""

    link: str
    nbytes: int
    bucket_megabytes: int
    repeats: int
    probed_bits_per_second: float = 0.0
    probed_latency_seconds: float = 0.0
    probed_intra_host_bits_per_second: float = 0.0
    cpu_cores: int = 0
    cells: list[BenchCell] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchReport:
        """A report from :meth:`as_dict`'s data (a saved run's JSON)."""
        fields = {f.name for f in dataclasses.fields(BenchCell)}
        cells = [BenchCell(**{k: v for k, v in cell.items() if k in fields})
                 for cell in data["cells"]]
        own = {f.name for f in dataclasses.fields(cls)} - {"cells"}
        return cls(**{k: v for k, v in data.items() if k in own}, cells=cells)

    def model(self) -> CellModel:
        """The cost model of this run's testbed: its probed links and its bytes."""
        if not (self.probed_bits_per_second and self.probed_intra_host_bits_per_second
                and self.cpu_cores):
            raise ValueError("this run has no probed link figures or core count (run it "
                             "again with weightsync-testbed 0.2 or later)")
        return CellModel(Link(self.probed_bits_per_second / 8, self.probed_latency_seconds),
                         Link(self.probed_intra_host_bits_per_second / 8),
                         self.nbytes, self.bucket_megabytes << 20, self.cpu_cores)

    def predict(self, costs: Mapping[str, EngineCosts] | None = None) -> None:
        """Fill every cell's prediction (and bound) from :meth:`model` and ``costs``
        (default: core's measured CPU costs)."""
        model = self.model()
        for cell in self.cells:
            _predict_cell(model, cell, costs)

    def cell(self, method: str, receivers: int) -> BenchCell | None:
        """The cell of ``method`` at ``receivers`` hosts, if measured."""
        return next((c for c in self.cells
                     if c.method == method and c.receivers == receivers), None)

    def methods(self) -> list[str]:
        """Methods in the order they were measured."""
        return list(dict.fromkeys(c.method for c in self.cells))

    def markdown(self) -> str:
        """The table: time and fraction of line rate per cell, beside the cost model's
        prediction and its error."""
        counts = sorted({c.receivers for c in self.cells})
        head = (f"{self.nbytes / 2**20:.0f} MiB from 1 actor host to N replica hosts, links "
                f"{self.link} full duplex (probed: "
                f"{self.probed_bits_per_second / 1e9:.3f} Gbit/s of payload, "
                f"{self.probed_latency_seconds * 1e6:.0f} us one way), {self.bucket_megabytes}"
                f" MiB buckets, median of {self.repeats}; each cell: measured (predicted, "
                "error)")
        lines = [head, "",
                 "| method | " + " | ".join(f"{n} host{'s' if n > 1 else ''}" for n in counts)
                 + " |",
                 "| --- |" + " --- |" * len(counts)]
        for method in self.methods():
            row = [f"| {method} "]
            for n in counts:
                cell = self.cell(method, n)
                row.append(f"| {_describe(cell)} " if cell else "| - ")
            lines.append("".join(row) + "|")
        lines.append("")
        for kind, cells in (
            ("backend", [c for c in self.cells if c.method in DEFAULT_ENGINE_KWARGS]),
            ("baseline", [c for c in self.cells if c.method not in DEFAULT_ENGINE_KWARGS]),
        ):
            errors = [abs(c.prediction_error) for c in cells if c.prediction_error is not None]
            if errors:
                lines.append(f"Largest prediction error: {max(errors):.0%} over "
                             f"{len(errors)} {kind} cells.")
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
            values = [(cell.line_rate_fraction if (cell := self.cell(m, n)) else 0.0)
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


def _predict_cell(
    model: CellModel, cell: BenchCell, costs: Mapping[str, EngineCosts] | None = None
) -> None:
    prediction = model.predict(cell.method, cell.receivers, costs)
    if prediction is not None:
        cell.predicted, cell.bound = prediction.seconds, prediction.bound


def _describe(cell: BenchCell) -> str:
    text = f"{cell.seconds:.2f} s, {cell.line_rate_fraction:.2f} of line"
    if cell.predicted is not None:
        text += f" ({cell.predicted:.2f} s, {cell.prediction_error:+.0%})"
    return text


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
    config = bench_config(backend, kwargs, bucket_mb)
    placement = HostPlacement([_ACTOR_HOST], replica_hosts)
    with synthetic_deployment(config, 1, (1,) * max(counts), nbytes, 64,
                              placement=placement) as (deployment, sent):
        measurements = [sync_seconds(deployment.manager(deployment.replicas[:n]),
                                     **{str(n): "transfer"}) for n in counts]
        medians = median_seconds(measurements, repeats)
    return [BenchCell(backend, n, medians[str(n)], sent, rate) for n in counts]


def _raw_write_cell(
    backend: str, kwargs: dict[str, Any], nbytes: int, repeats: int, rate: float
) -> BenchCell:
    config = CheckpointEngineConfig(backend=backend, engine_kwargs={backend: dict(kwargs)})
    with raw_writes(config, nbytes, on_host(_ACTOR_HOST), on_host("r0")) as write:
        seconds = median_seconds([write], repeats)["raw"]
    return BenchCell(f"raw {backend} write", 1, seconds, nbytes, rate)


def _raw_broadcast_cells(
    counts: list[int], nbytes: int, repeats: int, replica_hosts: list[str], rate: float
) -> list[BenchCell]:
    cells = []
    for n in counts:
        hosts = [_ACTOR_HOST, *replica_hosts[:n]]
        with raw_broadcast_group(nbytes, [on_host(host) for host in hosts]) as peers:
            seconds = median_seconds([raw_broadcasts(peers)], repeats)["raw"]
        cells.append(BenchCell("raw gloo broadcast", n, seconds, nbytes, rate))
    return cells


def _fetch_seconds(holder: Any, readers: list[Any], nbytes: int) -> dict[str, float]:
    """Seconds for ``readers`` to fetch a new object of ``nbytes`` from ``holder``."""
    wrapped = ray.get(holder.put.remote(nbytes))  # a new object every round
    start = time.perf_counter()
    got = ray.get([r.fetch.remote(wrapped) for r in readers])
    seconds = time.perf_counter() - start
    if got != [7 * nbytes] * len(readers):
        raise RuntimeError("the object store delivered wrong bytes")
    return {"fetch": seconds}


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
            seconds = median_seconds([lambda _step, n=n: _fetch_seconds(
                holder, readers[:n], nbytes)], repeats)["fetch"]
            cells.append(BenchCell("Ray object store", n, seconds, nbytes, rate))
    finally:
        for handle in (holder, *readers):
            # ray types .remote() as "handle or class" so that methods resolve: a handle
            ray.kill(cast(ActorHandle, handle))
    return cells


def run_testbed_bench(
    backends: list[str] | None = None,
    size_megabytes: int = 256,
    receivers: tuple[int, ...] = (1, 2, 3, 4),
    link: ShapedLink | None = None,
    bucket_megabytes: int = 64,
    repeats: int = 3,
) -> BenchReport:
    """Start a testbed (an actor host and ``max(receivers)`` replica hosts), measure every
    backend and the baselines on it, tear it down; returns the matrix."""
    link = link or ShapedLink("1gbit")
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
    report = BenchReport(link.rate or "", nbytes, bucket_megabytes, repeats,
                         cpu_cores=len(os.sched_getaffinity(0)))
    with Testbed(hosts=[_ACTOR_HOST, *replica_hosts], link=link, prefix="wstb"):
        nic = measure_link(on_host(_ACTOR_HOST), on_host(replica_hosts[0]))
        intra = measure_link(on_host(replica_hosts[0]), on_host(replica_hosts[0]))
        report.probed_bits_per_second, report.probed_latency_seconds = (
            nic.bandwidth * 8, nic.latency)
        report.probed_intra_host_bits_per_second = intra.bandwidth * 8
        print(f"  probed: {nic.bandwidth * 8 / 1e9:.3f} Gbit/s, {nic.latency * 1e6:.0f} us "
              f"between hosts; {intra.bandwidth * 8 / 1e9:.1f} Gbit/s inside one", flush=True)
        model = report.model()
        for backend in backends:
            kwargs = DEFAULT_ENGINE_KWARGS.get(backend, {})
            _add(report, model, _engine_cells(backend, kwargs, counts, nbytes,
                                              bucket_megabytes, repeats, replica_hosts, rate))
            if backend in ("nixl", "mooncake"):
                _add(report, model, [_raw_write_cell(backend, kwargs, nbytes, repeats, rate)])
        _add(report, model, _raw_broadcast_cells(counts, nbytes, repeats, replica_hosts, rate))
        _add(report, model, _object_store_cells(counts, nbytes, repeats, replica_hosts, rate))
    return report


def _add(report: BenchReport, model: CellModel, cells: list[BenchCell]) -> None:
    """Predict ``cells``, record them and say so (a matrix takes minutes)."""
    for cell in cells:
        _predict_cell(model, cell)
        report.cells.append(cell)
        print(f"  {cell.method}, {cell.receivers} receiver host(s): {_describe(cell)}",
              flush=True)
