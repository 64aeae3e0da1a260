"""Benchmark: several backends moving the same weights over the same deployment, one after
the other in one run (e.g. ``kimi`` against the ``mooncake`` ring and ``gloo``).

Each backend gets its own deployment of ``actor_world_size`` ranks and replicas of
``replica_sizes`` workers (started, measured, then shut down, so that only one holds memory
at a time); each figure is the median transfer-stage time of ``repeats`` syncs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from weightsync_core.bench.measure import (
    bench_config,
    gbps,
    median_seconds,
    sync_seconds,
    synthetic_deployment,
)

__all__ = ["ComparisonRow", "comparison_table", "run_comparison"]


@dataclass
class ComparisonRow:
    """One backend's result."""

    backend: str
    engine_kwargs: dict[str, Any]
    nbytes: int
    transfer_seconds: float
    sync_seconds: float

    @property
    def gbps(self) -> float:
        """Payload GB/s of the transfer stage (every rollout worker gets ``nbytes``)."""
        return gbps(self.nbytes, self.transfer_seconds)

    def as_dict(self) -> dict[str, Any]:
        """Row with the derived rate."""
        return {**asdict(self), "transfer_gbps": self.gbps}


def run_comparison(
    backends: list[tuple[str, dict[str, Any]]],
    actor_world_size: int = 2,
    replica_sizes: tuple[int, ...] = (2, 2),
    size_megabytes: int = 1024,
    bucket_megabytes: int = 64,
    num_tensors: int = 64,
    repeats: int = 3,
    verify: bool = True,
) -> list[ComparisonRow]:
    """Measure each ``(backend, engine_kwargs)`` on the same deployment shape and bytes."""
    rows = []
    for backend, kwargs in backends:
        config = bench_config(backend, kwargs, bucket_megabytes, verify)
        with synthetic_deployment(config, actor_world_size, replica_sizes,
                                  size_megabytes << 20, num_tensors) as (deployment, nbytes):
            sync = sync_seconds(deployment.manager(), transfer="transfer", total="total")
            medians = median_seconds([sync], repeats)
        rows.append(ComparisonRow(
            backend, dict(kwargs), nbytes, medians["transfer"], medians["total"]
        ))
    return rows


def comparison_table(
    rows: list[ComparisonRow], actor_world_size: int, replica_sizes: tuple[int, ...]
) -> str:
    """Human-readable summary, with each backend's time relative to the first."""
    head = rows[0]
    lines = [
        f"{head.nbytes / 2**30:.2f} GiB from {actor_world_size} actor ranks to replicas of "
        f"{list(replica_sizes)} workers",
        f"{'backend':28} {'transfer s':>10} {'sync s':>8} {'GB/s':>7} {'time vs first':>13}",
    ]
    for row in rows:
        label = row.backend + (f" {row.engine_kwargs}" if row.engine_kwargs else "")
        lines.append(
            f"{label[:28]:28} {row.transfer_seconds:10.3f} {row.sync_seconds:8.3f} "
            f"{row.gbps:7.2f} {row.transfer_seconds / head.transfer_seconds:12.2f}x"
        )
    return "\n".join(lines)
