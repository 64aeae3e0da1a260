"""The ``weightsync-testbed`` command: bring a testbed up, clean up after a crashed one, run
the line-rate benchmark (also reachable as ``weightsync bench --testbed``), the delta-sync
benchmark across a link or the sharded-delivery benchmark, fit engine costs from saved
runs, or print saved runs beside the current cost model's predictions."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from weightsync_testbed.network import Link
from weightsync_testbed.testbed import Testbed, cleanup

if TYPE_CHECKING:
    from weightsync_testbed.bench import BenchReport

__all__ = ["add_bench_arguments", "bench_main", "main", "run_bench"]


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared with ``weightsync bench --testbed``)."""
    parser.add_argument("backends", nargs="*",
                        help="backends to measure (default: every installed CPU backend: "
                        "gloo, nixl, mooncake, kimi)")
    parser.add_argument("--size-mb", type=int, default=256, help="state dict size (MiB)")
    parser.add_argument("--receivers", default="1,2,3,4",
                        help="numbers of replica hosts, e.g. 1,2,4")
    parser.add_argument("--link", default="1gbit", help="every host's NIC rate (tc units)")
    parser.add_argument("--bucket-mb", type=int, default=64, help="bucket size (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs per cell (median)")
    parser.add_argument("--out", default="testbed-bench",
                        help="directory for the markdown table, the JSON and the PNG chart")


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark matrix; print the table and write table, JSON and chart."""
    from weightsync_testbed.bench import run_testbed_bench

    report = run_testbed_bench(
        backends=list(args.backends), size_megabytes=args.size_mb,
        receivers=tuple(int(n) for n in args.receivers.split(",")), link=Link(args.link),
        bucket_megabytes=args.bucket_mb, repeats=args.repeats,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = report.markdown()
    (out / "testbed-bench.md").write_text(table + "\n")
    (out / "testbed-bench.json").write_text(json.dumps(report.as_dict(), indent=2))
    report.chart(out / "testbed-bench.png")
    print(table)
    print(f"wrote {out}/testbed-bench.md, .json and .png")
    return 0


def _load_reports(paths: list[str]) -> list[BenchReport]:
    from weightsync_testbed.bench import BenchReport

    return [BenchReport.from_dict(json.loads(Path(path).read_text())) for path in paths]


def _fit(args: argparse.Namespace) -> int:
    from weightsync_testbed.bench import DEFAULT_ENGINE_KWARGS
    from weightsync_testbed.prediction import fit_engine_costs

    samples = [(report.model(), cell.method, cell.seconds)
               for report in _load_reports(args.runs) for cell in report.cells
               if cell.receivers == 1 and cell.method in DEFAULT_ENGINE_KWARGS]
    for backend, costs in fit_engine_costs(samples).items():
        print(f"{backend}: per_bucket={costs.per_bucket:.4f} s, "
              f"per_byte={costs.per_byte * 2**20 * 1e3:.3f} ms/MiB")
    return 0


def _predict(args: argparse.Namespace) -> int:
    for report in _load_reports(args.runs):
        report.predict()
        print(report.markdown(), end="\n\n")
    return 0


def _delta(args: argparse.Namespace) -> int:
    """Full against delta syncs from an actor host to a replica host over one shaped link."""
    from weightsync_core.bench.delta import run_delta_benchmark
    from weightsync_testbed.bench import DEFAULT_ENGINE_KWARGS
    from weightsync_testbed.placement import HostPlacement

    link = Link(args.link)
    with Testbed(hosts=["a0", "r0"], link=link, prefix="wstd"):
        result = run_delta_benchmark(
            args.backend, DEFAULT_ENGINE_KWARGS.get(args.backend, {}), args.size_mb,
            repeats=args.repeats, bucket_megabytes=args.bucket_mb,
            learning_rate=args.learning_rate, placement=HostPlacement(["a0"], ["r0"]),
        )
    print(result.table())
    rate = link.bits_per_second
    if rate:
        full = result.row("full")
        print(f"full sync at line rate ({args.link}): {full.wire_bytes * 8 / rate:.2f} s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result.as_dict(), indent=2))
        print(f"wrote {args.json_out}")
    return 0


def _quantized(args: argparse.Namespace) -> int:
    """bf16 against fp8_block syncs from an actor host to a replica host over one shaped
    link."""
    from weightsync_core.bench.quantized import run_quantized_benchmark
    from weightsync_testbed.bench import DEFAULT_ENGINE_KWARGS
    from weightsync_testbed.placement import HostPlacement

    link = Link(args.link)
    with Testbed(hosts=["a0", "r0"], link=link, prefix="wstq"):
        result = run_quantized_benchmark(
            args.backend, DEFAULT_ENGINE_KWARGS.get(args.backend, {}), args.size_mb,
            repeats=args.repeats, bucket_megabytes=args.bucket_mb,
            placement=HostPlacement(["a0"], ["r0"]))
    print(result.table())
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result.as_dict(), indent=2))
        print(f"wrote {args.json_out}")
    return 0


def _sharded(args: argparse.Namespace) -> int:
    """Sharded delivery against full copies, every process on a host of its own."""
    from weightsync_testbed.sharded_bench import run_sharded_bench

    layouts = []
    for item in args.layouts.split(","):
        actors, _, tp = item.partition("x")
        layouts.append((int(actors), int(tp)))
    report = run_sharded_bench(
        layouts, args.size_mb, Link(args.link), args.bucket_mb, args.repeats,
        sharded=args.sharded.split(","), full_copy=args.full_copy.split(","),
        changed_fraction=args.changed_fraction)
    print(report.markdown())
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report.as_dict(), indent=2))
        print(f"wrote {args.json_out}")
    return 0


def _up(args: argparse.Namespace) -> int:
    with Testbed(hosts=args.hosts.split(","), link=Link(args.link), prefix=args.prefix,
                 connect=False) as testbed:
        print(f"Ray cluster at {testbed.cluster.address}; hosts: "
              + ", ".join(f"{h}={testbed.address(h)}" for h in testbed.hosts))
        print(f"run inside a host: ip netns exec {args.prefix}-<host> <command>; "
              "Ctrl-C tears everything down")
        signal.pause()
    return 0


def _cleanup(args: argparse.Namespace) -> int:
    removed = cleanup(args.prefix)
    print(json.dumps(removed))
    return 0


def _add_host_pair_arguments(parser: argparse.ArgumentParser, size_help: str,
                             bucket_help: str) -> None:
    """The arguments of a benchmark from an actor host to a replica host: the backend, the
    model's size, the link, the repeats, the bucket size and the JSON output."""
    parser.add_argument("backend", nargs="?", default="gloo",
                        help="gloo, nixl or mooncake (default: gloo)")
    parser.add_argument("--size-mb", type=int, default=1024, help=size_help)
    parser.add_argument("--link", default="1gbit", help="every host's NIC rate (tc units)")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs of each kind")
    parser.add_argument("--bucket-mb", type=int, default=64, help=bucket_help)
    parser.add_argument("--json-out", help="also write the result as JSON to this file")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``weightsync-testbed``."""
    parser = argparse.ArgumentParser(prog="weightsync-testbed", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="create hosts and a Ray cluster; Ctrl-C tears down")
    up.add_argument("--hosts", default="h0,h1", help="host names, e.g. a0,r0,r1")
    up.add_argument("--link", default="1gbit", help="every host's NIC rate (tc units)")
    up.add_argument("--prefix", default="wst", help="name prefix of namespaces/interfaces")
    up.set_defaults(run=_up)
    clean = commands.add_parser("cleanup", help="remove what a crashed testbed left behind")
    clean.add_argument("--prefix", default=None,
                       help="only this testbed's leftovers (default: every testbed's)")
    clean.set_defaults(run=_cleanup)
    bench = commands.add_parser("bench", help="the line-rate benchmark matrix")
    add_bench_arguments(bench)
    bench.set_defaults(run=run_bench)
    delta = commands.add_parser(
        "delta", help="full against delta syncs (config.delta) from an actor host to a "
        "replica host over one shaped link")
    _add_host_pair_arguments(delta, "bf16 weights (MiB)", "bucket size (MiB); smaller buckets "
                             "let a delta sync's patches leave while the rest is still being "
                             "diffed")
    delta.add_argument("--learning-rate", type=float, default=1.6e-5,
                       help="each step's move per fp32 master element (1.6e-5: about 2%% "
                       "of the bf16 elements change)")
    delta.set_defaults(run=_delta)
    quantized = commands.add_parser(
        "quantized", help="bf16 against fp8_block syncs (config.rollout_quantization) from an "
        "actor host to a replica host over one shaped link")
    _add_host_pair_arguments(quantized, "fp32 masters (MiB)", "bucket size (MiB)")
    quantized.set_defaults(run=_quantized)
    sharded = commands.add_parser(
        "sharded", help="sharded delivery against full copies: actor hosts into replicas of "
        "TP workers, every process on a host of its own")
    sharded.add_argument("--layouts", default="2x2,4x4",
                         help="AxTP,...: A actor hosts into 2 replicas of TP workers")
    sharded.add_argument("--size-mb", type=int, default=256, help="float32 weights (MiB)")
    sharded.add_argument("--link", default="1gbit", help="every host's NIC rate (tc units)")
    sharded.add_argument("--bucket-mb", type=int, default=64, help="bucket size (MiB)")
    sharded.add_argument("--repeats", type=int, default=3, help="timed syncs of each method")
    sharded.add_argument("--sharded", default="nixl_sharded",
                         help="sharded backends, comma-separated; BACKEND+direct without "
                         "relays, BACKEND+delta for its delta syncs")
    sharded.add_argument("--full-copy", default="mooncake,mooncake:8,nixl,gloo",
                         help="full-copy backends to compare with, comma-separated; "
                         "BACKEND:MiB uses buckets of that size, BACKEND+delta its delta "
                         "syncs")
    sharded.add_argument("--changed-fraction", type=float, default=0.02,
                         help="what each delta sync (+delta methods) changes of every "
                         "tensor on every actor rank")
    sharded.add_argument("--json-out", help="also write the result as JSON to this file")
    sharded.set_defaults(run=_sharded)
    fit = commands.add_parser(
        "fit", help="fit each backend's engine costs from the 1-host cells of saved runs")
    fit.add_argument("runs", nargs="+", help="testbed-bench.json files")
    fit.set_defaults(run=_fit)
    predict = commands.add_parser(
        "predict", help="print saved runs with predictions from the current cost model")
    predict.add_argument("runs", nargs="+", help="testbed-bench.json files")
    predict.set_defaults(run=_predict)
    return parser


def bench_main(argv: Sequence[str]) -> int:
    """``weightsync bench --testbed ARGS``: core's command finds this through the
    ``weightsync.bench`` entry-point group (name ``testbed``) and runs the benchmark with
    ``ARGS`` (this package's ``bench`` options)."""
    return main(["bench", *argv])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``weightsync-testbed``."""
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
