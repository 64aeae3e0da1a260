"""Every backend's topology options for a cluster, predicted and ranked."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from weightsync_core.plan.layout import Cluster, Workload
from weightsync_core.plan.topologies import (
    EngineCosts,
    Prediction,
    chained_broadcast,
    fan_out,
    ring,
    sharded_delivery,
    sharded_pull,
)

__all__ = [
    "ASSUMED_GPU_COSTS",
    "MEASURED_CPU_COSTS",
    "PlannedOption",
    "RankedPrediction",
    "plan",
    "plan_table",
    "sharded_plan",
    "topology_options",
]

MEASURED_CPU_COSTS: Mapping[str, EngineCosts] = {
    "gloo": EngineCosts(per_bucket=0.0, per_byte=0.210e-3 / 2**20),
    "nixl": EngineCosts(per_bucket=0.0005, per_byte=0.217e-3 / 2**20),
    "mooncake": EngineCosts(per_bucket=0.0012, per_byte=0.153e-3 / 2**20),
    "kimi": EngineCosts(per_bucket=0.0, per_byte=0.464e-3 / 2**20),
}
"""Engine costs beyond the wire with buckets in host memory over TCP, fitted
(``weightsync-testbed fit``) from the 1-host cells of the testbed's 1 Gbit/s runs with 64 and
8 MiB buckets, 2026-12-06 at core 0.18.0 (see ``docs/planner.md``, "Predicted and measured on
the testbed")."""

ASSUMED_GPU_COSTS: Mapping[str, EngineCosts] = {
    **{name: EngineCosts(per_bucket=0.001) for name in ("nccl", "hccl", "nixl", "mooncake",
                                                        "kimi")},
    "gloo": MEASURED_CPU_COSTS["gloo"],  # gloo moves host memory over TCP on any cluster
}
"""Engine costs for device buckets over RDMA and NVLink (or HCCS): assumed (1 ms a bucket
for the control round trip and launch; no copy beyond the wire), not measured: no GPU
cluster has run these engines yet."""

_DEVICE_BACKENDS = {
    "cpu": ("gloo", "nixl", "mooncake", "kimi"),
    "gpu": ("nccl", "nixl", "mooncake", "kimi", "gloo"),
    "npu": ("hccl", "gloo"),
}


@dataclass(frozen=True)
class PlannedOption:
    """One way to run a backend: the engine kwargs that select it, and its predictor."""

    backend: str
    engine_kwargs: dict[str, Any]
    predict: Callable[[Cluster, Workload, EngineCosts], Prediction]


def topology_options(backend: str, cluster: Cluster, device: str = "cpu") -> list[PlannedOption]:
    """The topology options of ``backend`` on ``cluster``: broadcast engines with one sender
    and with every actor rank of actor host 0 sending; kimi with each relay collective."""
    rdma = {} if device == "cpu" else {"protocol": "rdma"}
    home = cluster.actor_host(0)
    local = sum(1 for rank in range(cluster.actor_ranks) if cluster.actor_host(rank) == home)
    senders = min(local, cluster.rollout_workers)
    if backend in ("gloo", "nccl", "hccl"):
        topology = fan_out if backend == "gloo" else chained_broadcast
        counts = sorted({1, senders})
        return [PlannedOption(backend, {"senders": k} if k > 1 else {},
                              partial(topology, backend, senders=k))
                for k in counts]
    if backend in ("nixl", "mooncake"):
        kwargs = {"device": "cpu" if device == "cpu" else "cuda"}
        if backend == "mooncake":
            kwargs |= rdma
        return [PlannedOption(backend, kwargs, partial(ring, backend))]
    if backend == "kimi":
        collectives = ("nccl", "gloo") if device == "gpu" else ("gloo",)
        return [PlannedOption(backend, {"collective": name} | rdma,
                              partial(sharded_pull, backend,
                                      relay="chained" if name == "nccl" else "fan-out"))
                for name in collectives]
    raise ValueError(
        f"no cost model for backend {backend!r}; planned backends: gloo, nccl, hccl, nixl, "
        "mooncake, kimi (naive only runs colocated, in one process)"
    )


@dataclass(frozen=True)
class RankedPrediction:
    """A prediction with the engine kwargs that select its option."""

    prediction: Prediction
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def plan(
    cluster: Cluster,
    workload: Workload,
    device: str = "cpu",
    backends: Iterable[str] | None = None,
    costs: Mapping[str, EngineCosts] | None = None,
) -> list[RankedPrediction]:
    """Predict every backend and topology option on ``cluster``, fastest first.

    ``device`` is ``"cpu"`` (buckets in host memory, TCP: the measured costs), ``"gpu"``
    (CUDA buckets, RDMA/NVLink) or ``"npu"`` (Ascend, HCCL) with assumed costs; ``costs``
    overrides either table.
    """
    if device not in _DEVICE_BACKENDS:
        raise ValueError(f"device must be one of {', '.join(_DEVICE_BACKENDS)}, got {device!r}")
    table = dict(MEASURED_CPU_COSTS if device == "cpu" else ASSUMED_GPU_COSTS)
    table.update(costs or {})
    chosen = list(dict.fromkeys(backends or _DEVICE_BACKENDS[device]))
    unfit = [name for name in chosen if name not in _DEVICE_BACKENDS[device]]
    if unfit:
        raise ValueError(
            f"backend(s) {', '.join(unfit)} do not run on device {device!r}; on it: "
            f"{', '.join(_DEVICE_BACKENDS[device])} (naive only runs colocated)"
        )
    ranked = []
    for backend in chosen:
        for option in topology_options(backend, cluster, device):
            prediction = option.predict(cluster, workload, table.get(backend, EngineCosts()))
            ranked.append(RankedPrediction(prediction, option.engine_kwargs))
    return sorted(ranked, key=lambda item: item.prediction.seconds)


def sharded_plan(cluster: Cluster, workload: Workload, device: str = "cpu",
                 replicated_fraction: float = 0.0,
                 costs: Mapping[str, EngineCosts] | None = None,
                 relay: bool | None = None) -> Prediction:
    """Sharded delivery on ``cluster`` (:func:`~.topologies.sharded_delivery`: each rollout
    worker receives only its shard, from every actor rank at once), priced with nixl's
    engine costs for ``device`` (a point-to-point engine; ``costs`` overrides): the engines
    ``nixl_sharded`` and ``mooncake_sharded`` run it by one-sided writes, ``gloo_sharded``
    over gloo. ``relay``: with relays between replicas (True), without (False), or the
    faster of the two (None; the engines relay by default where that unloads the busiest
    sender)."""
    if device not in _DEVICE_BACKENDS:
        raise ValueError(f"device must be one of {', '.join(_DEVICE_BACKENDS)}, got {device!r}")
    table = dict(MEASURED_CPU_COSTS if device == "cpu" else ASSUMED_GPU_COSTS)
    table.update(costs or {})
    choices = [False, True] if relay is None else [relay]
    predictions = [sharded_delivery("nixl", cluster, workload, table["nixl"],
                                    replicated_fraction, relay=choice) for choice in choices]
    return min(predictions, key=lambda prediction: prediction.seconds)


def plan_table(ranked: list[RankedPrediction]) -> str:
    """A markdown table of ranked predictions."""
    lines = ["| rank | backend | option | engine_kwargs | predicted | bound |",
             "| --- | --- | --- | --- | --- | --- |"]
    for position, item in enumerate(ranked, start=1):
        p = item.prediction
        kwargs = ", ".join(f"{k}={v!r}" for k, v in item.engine_kwargs.items()) or "-"
        lines.append(f"| {position} | {p.backend} | {p.option} | {kwargs} | "
                     f"{_seconds(p.seconds)} | {p.bound} |")
    return "\n".join(lines)


def _seconds(value: float) -> str:
    if value >= 3600:
        return f"{value / 3600:.1f} h"
    if value >= 60:
        return f"{value / 60:.1f} min"
    return f"{value:.2f} s"
