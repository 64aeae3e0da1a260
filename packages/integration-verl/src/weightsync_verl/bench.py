"""``weightsync-verl-bench``: verl's own NIXL and Mooncake engines against weightsync's, on
the same bytes, in one run.

Every engine runs in the same verl deployment (verl's worker groups, verl's
``CheckpointEngineWorker``, one trainer rank sending ``--mib`` MiB of float32 tensors to
``--receivers`` rollout workers), one after the other: a warm-up sync, ``--repeats`` timed
syncs (the receivers consume every tensor without hashing it), then one sync with every
tensor digested and compared with the trainer's, on both sides. Each figure is the median
wall time of ``update_weights`` as the trainer sees it.

verl's engines are run as verl ships them, with the exceptions that CPU-only machines force
(printed with the results): verl's NIXL engine pins its CPU buckets with
``pin_memory=True`` and calls ``torch.cuda.synchronize()`` after every bucket, both of which
need a CUDA driver, so here its buckets are allocated unpinned and the synchronize returns at
once (there is no device to wait for; the engine is otherwise unchanged, see
:mod:`weightsync_verl.bench_plugins`); verl's Mooncake engine opens the Transfer Engine with
the ``rdma`` protocol only and needs vLLM's or SGLang's ``StatelessProcessGroup``, so it
cannot run without an RDMA NIC and is reported as not run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import ray
from verl.workers.config import CheckpointEngineConfig

from weightsync_core.bench.measure import median_seconds
from weightsync_verl.scenario import VerlCluster, make_cluster, make_manager, save_tiny_model

__all__ = ["BenchRow", "main", "run_bench"]

WEIGHTSYNC_MANAGER = "weightsync_verl.CheckpointEngineManager"
UNPINNED_VERL_NIXL = "verl_nixl_unpinned"
"""verl's NIXL engine, adapted to CPU-only machines (see :mod:`weightsync_verl.bench_plugins`)."""


@dataclass
class BenchRow:
    """One engine's result (``seconds`` is ``None`` when it could not run)."""

    engine: str
    manager: str
    seconds: float | None
    bit_exact: bool | None
    note: str = ""


def _engines(bucket_mb: int) -> list[tuple[str, str | None, CheckpointEngineConfig | str]]:
    """``(engine, manager, config or why it cannot run)`` in the order they run."""

    def config(backend: str, module: str, **kwargs: Any) -> CheckpointEngineConfig:
        return CheckpointEngineConfig(backend=backend, update_weights_bucket_megabytes=bucket_mb,
                                      engine_kwargs={backend: kwargs},
                                      custom_backend_module=module)

    verl_nixl = config(UNPINNED_VERL_NIXL, "weightsync_verl.bench_plugins", device="cpu")
    return [
        ("verl nixl", None, verl_nixl),
        ("weightsync nixl", None, config("weightsync_nixl", "weightsync_verl")),
        ("weightsync nixl", WEIGHTSYNC_MANAGER, config("weightsync_nixl", "weightsync_verl")),
        ("verl mooncake", None,
         "verl's MooncakeCheckpointEngine opens the Transfer Engine with protocol 'rdma' only "
         "and needs vLLM's or SGLang's StatelessProcessGroup: no RDMA NIC here"),
        ("weightsync mooncake", None, config("weightsync_mooncake", "weightsync_verl")),
        ("weightsync mooncake", WEIGHTSYNC_MANAGER,
         config("weightsync_mooncake", "weightsync_verl")),
    ]


def _measure(cluster: VerlCluster, manager_class: str | None, repeats: int) -> tuple[float, bool]:
    manager = make_manager(cluster, manager_class)

    def sync(step: int) -> dict[str, float]:
        start = time.perf_counter()
        manager.update_weights(global_steps=step)
        return {"sync": time.perf_counter() - start}

    # a RayWorkerGroup binds its workers' @register methods at run time
    cluster.rollout.set_recording(False)  # pyright: ignore[reportAttributeAccessIssue]
    seconds = median_seconds([sync], repeats)["sync"]
    cluster.rollout.set_recording(True)  # pyright: ignore[reportAttributeAccessIssue]
    expected = cluster.perturb(repeats + 1)
    manager.update_weights(global_steps=repeats + 1)
    exact = all(report["received"] == expected for report in cluster.reports())
    return seconds, exact


def run_bench(mib: int = 512, receivers: int = 2, repeats: int = 3, bucket_mb: int = 64,
              only: str | None = None) -> list[BenchRow]:
    """Run every engine of :func:`_engines` (those whose ``"<engine> / <manager>"`` contains
    ``only``, if given) on the same bytes; returns one row each."""
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        model_path = save_tiny_model(directory)  # the rollout's model config only
        for engine, manager_class, config in _engines(bucket_mb):
            manager_name = "weightsync" if manager_class else "verl"
            if only and only not in f"{engine} / {manager_name}":
                continue
            if isinstance(config, str):
                rows.append(BenchRow(engine, manager_name, None, None, f"not run: {config}"))
                continue
            cluster = make_cluster(config, model_path, num_trainer=1, num_rollout=receivers,
                                   replica_size=1, weights=f"synthetic:{mib}")
            try:
                seconds, exact = _measure(cluster, manager_class, repeats)
            except Exception as exc:  # a failing engine is a result too: report it, go on
                rows.append(BenchRow(engine, manager_name, None, False,
                                     f"failed: {type(exc).__name__}: {str(exc)[-300:]}"))
                continue
            finally:
                cluster.shutdown()
            unpinned = config.backend == UNPINNED_VERL_NIXL
            note = "buckets unpinned, no cuda.synchronize (no CUDA here)" if unpinned else ""
            rows.append(BenchRow(engine, manager_name, seconds, exact, note))
    return rows


def table(rows: list[BenchRow], mib: int, receivers: int) -> str:
    """The rows as markdown, with GB/s (payload per receiver) and the time relative to
    verl's engine on the same transport."""
    baseline = {row.engine.split()[-1]: row.seconds for row in rows
                if row.engine.startswith("verl") and row.seconds}
    lines = ["| engine | manager | median sync (s) | GB/s | vs verl's engine | bit-exact | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if row.seconds is None:
            lines.append(f"| {row.engine} | {row.manager} | - | - | - | - | {row.note} |")
            continue
        verl = baseline.get(row.engine.split()[-1])
        ratio = f"{row.seconds / verl:.2f}x the time" if verl else "-"
        gbps = (mib << 20) / row.seconds / 1e9
        lines.append(f"| {row.engine} | {row.manager} | {row.seconds:.2f} | {gbps:.2f} | "
                     f"{ratio} | {'yes' if row.bit_exact else 'NO'} | {row.note} |")
    return "\n".join([f"{mib} MiB, 1 sender -> {receivers} receivers", "", *lines])


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="weightsync-verl-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="payload (default 512)")
    parser.add_argument("--receivers", type=int, default=2, help="rollout workers (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs (default 3)")
    parser.add_argument("--bucket-mb", type=int, default=64, help="bucket MiB (default 64)")
    parser.add_argument("--only", help="run the rows whose '<engine> / <manager>' contains "
                                       "this, e.g. 'nixl' or 'weightsync nixl / verl'")
    args = parser.parse_args(argv)
    ray.init(num_cpus=16, include_dashboard=False)
    try:
        rows = run_bench(args.mib, args.receivers, args.repeats, args.bucket_mb, args.only)
    finally:
        ray.shutdown()
    print(table(rows, args.mib, args.receivers))
    return 0 if all(row.bit_exact is not False for row in rows) else 1
