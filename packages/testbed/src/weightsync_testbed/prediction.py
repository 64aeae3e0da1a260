"""What core's cost model (``weightsync_core.plan``) predicts for each cell of the testbed
benchmark: one actor host, ``n`` replica hosts of one worker each, every host's processes
sharing the machine's cores."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from weightsync_core.plan import (
    MEASURED_CPU_COSTS,
    Cluster,
    EngineCosts,
    Link,
    Prediction,
    Workload,
    fan_out,
    ring,
    sharded_pull,
)

__all__ = ["CellModel", "fit_engine_costs"]


@dataclass(frozen=True)
class CellModel:
    """The testbed's measured links and the benchmark's bytes, ready to predict cells."""

    nic: Link
    intra_host: Link
    nbytes: int
    bucket_bytes: int
    cpu_cores: int

    def predict(
        self, method: str, receivers: int, costs: Mapping[str, EngineCosts] | None = None
    ) -> Prediction | None:
        """The prediction for ``method`` (a backend, ``raw <backend> write``, ``raw gloo
        broadcast`` or ``Ray object store``) at ``receivers`` hosts with ``costs`` (default:
        core's measured CPU costs); None if unmodelled."""
        cluster = Cluster(self.nic, self.intra_host, replicas=receivers,
                          shared_cpu_cores=self.cpu_cores)
        synced = Workload(self.nbytes, self.bucket_bytes)
        whole = Workload(self.nbytes, self.nbytes)  # the baselines move one message
        engine = (MEASURED_CPU_COSTS if costs is None else costs).get(method, EngineCosts())
        if method in ("nixl", "mooncake"):
            return ring(method, cluster, synced, engine)
        if method == "gloo":
            return fan_out(method, cluster, synced, engine)
        if method == "kimi":
            return sharded_pull(method, cluster, synced, engine)
        if method.startswith("raw ") and method.endswith(" write"):
            return ring(method, cluster, whole, EngineCosts())
        if method in ("raw gloo broadcast", "Ray object store"):
            return fan_out(method, cluster, whole, EngineCosts())
        return None


def fit_engine_costs(
    samples: Iterable[tuple[CellModel, str, float]],
) -> dict[str, EngineCosts]:
    """Fit each backend's costs from 1-receiver syncs: ``(model, backend, seconds)``.

    A sync to one receiver host of ``B`` buckets of ``s`` bytes takes ``B * (wire(s) +
    per_bucket * contention + per_byte * s)`` (contention 1 where the cores are at least
    the two processes). One bucket size gives ``per_bucket``; two or more give both by
    least squares.
    """
    extra: dict[str, list[tuple[float, float]]] = {}
    for model, backend, seconds in samples:
        prediction = model.predict(backend, 1, {})
        if prediction is None:
            raise ValueError(f"no cost model for {backend!r}")
        if model.cpu_cores < 2:
            raise ValueError("fit engine costs from runs on at least 2 cores")
        wire = prediction.seconds / prediction.buckets
        extra.setdefault(backend, []).append(
            (model.bucket_bytes, seconds / prediction.buckets - wire))
    fitted = {}
    for backend, points in extra.items():
        sizes = {size for size, _ in points}
        if len(sizes) < 2:
            fitted[backend] = EngineCosts(per_bucket=max(0.0, statistics.fmean(
                value for _, value in points)))
            continue
        slope, intercept = statistics.linear_regression(*zip(*points, strict=True))
        fitted[backend] = EngineCosts(per_bucket=max(0.0, intercept), per_byte=max(0.0, slope))
    return fitted
