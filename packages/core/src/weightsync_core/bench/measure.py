"""What every benchmark shares: a deployment holding synthetic weights, warm-up, timed
rounds and their medians, and the rows of a result table.

Measurements alternate: each round runs every measurement once, in order, so that drifting
load on the machine affects all alike; a warm-up round first (connections, buffers, page
faults) is not counted.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import ray

from weightsync_core.api.config import CheckpointEngineConfig
from weightsync_core.api.passes import passes_in
from weightsync_core.orchestration.deployment import Deployment, Placement
from weightsync_core.orchestration.local_ray import ensure_ray
from weightsync_core.orchestration.manager import CheckpointEngineManager

__all__ = [
    "Measurement",
    "bench_config",
    "gbps",
    "median_seconds",
    "method_rows",
    "pass_rows",
    "passes_of",
    "sync_seconds",
    "synthetic_deployment",
]

Measurement = Callable[[int], Mapping[str, float]]
"""One timed run at a step (0: the warm-up): seconds by figure name."""


def bench_config(
    backend: str, engine_kwargs: Mapping[str, Any], bucket_megabytes: int, verify: bool = True
) -> CheckpointEngineConfig:
    """The config of a benchmarked ``backend``: its engine options, a bucket size, and a
    sync timeout long enough for large payloads on a loaded machine."""
    return CheckpointEngineConfig(
        backend=backend, update_weights_bucket_megabytes=bucket_megabytes, verify=verify,
        engine_kwargs={backend: dict(engine_kwargs)}, sync_timeout_seconds=600,
    )


@contextmanager
def synthetic_deployment(
    config: CheckpointEngineConfig,
    actor_world_size: int,
    replica_sizes: Sequence[int],
    size_bytes: int,
    num_tensors: int,
    placement: Placement | None = None,
    columns: int | None = None,
) -> Iterator[tuple[Deployment, int]]:
    """A started :class:`~weightsync_core.orchestration.deployment.Deployment` whose every
    actor rank holds
    ``num_tensors`` equal float32 tensors of about ``size_bytes`` in all (matrices of
    ``columns`` columns where given); yields it with the bytes each rank holds, and shuts it
    down on leaving."""
    ensure_ray()
    deployment = Deployment(config, actor_world_size, replica_sizes, placement=placement)
    try:
        sizes = ray.get([actor.set_uniform_weights.remote(size_bytes, num_tensors, columns)
                         for actor in deployment.actors])
        yield deployment, sizes[0]
    finally:
        deployment.shutdown()


def sync_seconds(manager: CheckpointEngineManager, passes: str | None = None,
                 **stages: str) -> Measurement:
    """A measurement of one sync by ``manager``: the seconds of each named stage, e.g.
    ``sync_seconds(manager, transfer="transfer", sync="total")``, and, with ``passes``, of
    each pass over the bytes (figures ``<passes>/<pass>``: :func:`passes_of`)."""

    def measure(step: int) -> dict[str, float]:
        metrics = manager.update_weights_sync(global_steps=step)
        figures = {name: metrics[f"weightsync/seconds/{stage}"]
                   for name, stage in stages.items()}
        if passes is not None:
            figures |= {f"{passes}/{name}": seconds for name, seconds in passes_in(metrics).items()}
        return figures

    return measure


def passes_of(figures: Mapping[str, float], prefix: str) -> dict[str, float]:
    """The passes :func:`sync_seconds` measured under ``prefix``: seconds by pass name."""
    return {name.removeprefix(f"{prefix}/"): seconds for name, seconds in figures.items()
            if name.startswith(f"{prefix}/")}


def pass_rows(columns: Mapping[str, Mapping[str, float]], width: int = 20) -> list[str]:
    """The per-pass breakdown of one or more measured syncs (``columns``: a heading and the
    seconds of each pass): the longest any process of the sync spent in each pass; passes
    overlap, so they may add up to more than the sync."""
    names = sorted({name for passes in columns.values() for name in passes})
    if not names:
        return []
    return [
        "per pass (the longest any process spent in it, median seconds; passes overlap):",
        f"  {'pass':{width}}" + "".join(f" {heading:>12}" for heading in columns),
        *(f"  {name:{width}}" + "".join(f" {passes.get(name, 0.0):12.3f}"
                                        for passes in columns.values())
          for name in names),
    ]


def median_seconds(
    measurements: Sequence[Measurement], repeats: int, warm_up: bool = True
) -> dict[str, float]:
    """Run ``measurements`` in turn: a warm-up round (step 0, unless not ``warm_up``), then
    ``repeats`` timed rounds (steps 1 to ``repeats``); the median of every figure."""
    if warm_up:
        for measure in measurements:
            measure(0)
    samples: dict[str, list[float]] = defaultdict(list)
    for step in range(1, repeats + 1):
        for measure in measurements:
            for name, seconds in measure(step).items():
                samples[name].append(seconds)
    return {name: statistics.median(values) for name, values in samples.items()}


def gbps(nbytes: int, seconds: float) -> float:
    """Payload GB/s of ``nbytes`` moved in ``seconds``."""
    return nbytes / seconds / 1e9


def method_rows(rows: Sequence[tuple[str, float]], nbytes: int, width: int) -> list[str]:
    """A table's header and one line per ``(method, seconds)``, with GB/s of ``nbytes``."""
    return [
        f"{'method':{width}} {'seconds':>9} {'GB/s':>8}",
        *(f"{name:{width}} {seconds:9.3f} {gbps(nbytes, seconds):8.2f}"
          for name, seconds in rows),
    ]
