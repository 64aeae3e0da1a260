"""The ``weightsync`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from weightsync_core.registry import CheckpointEngineRegistry

__all__ = ["main"]


def _backends(args: argparse.Namespace) -> int:
    report = CheckpointEngineRegistry.available(probe=not args.no_probe)
    if args.json:
        rows = {
            name: {**info.__dict__, "state": info.state.value} for name, info in report.items()
        }
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'backend':18} {'distribution':22} {'state':14} details")
    for name, info in report.items():
        details = info.reason or info.target or ""
        if info.install_hint and info.state.value in ("not installed", "broken"):
            details = f"{details}; install: {info.install_hint}" if details else info.install_hint
        print(f"{name:18} {info.distribution or '-':22} {info.state.value:14} {details}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    common = {"size_megabytes": args.size_mb, "num_tensors": args.tensors,
              "repeats": args.repeats, "verify": not args.no_verify}
    if args.backend == "gloo":
        from weightsync_core.benchmark import run_gloo_benchmark

        result = run_gloo_benchmark(
            receivers=args.receivers or 2, bucket_megabytes=args.bucket_mb or 256, **common
        )
    else:
        from weightsync_core.engines.ring import RingCheckpointEngine
        from weightsync_core.ring_benchmark import run_ring_benchmark

        if not issubclass(CheckpointEngineRegistry.get(args.backend), RingCheckpointEngine):
            print(f"weightsync bench: {args.backend!r} is neither gloo nor a ring backend "
                  "(nixl, mooncake); compare it with others: weightsync compare "
                  f"{args.backend} gloo", file=sys.stderr)
            return 2
        result = run_ring_benchmark(
            args.backend, json.loads(args.engine_kwargs), receivers=args.receivers or 3,
            bucket_megabytes=args.bucket_mb or 64, **common,
        )
    print(result.table())
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(result.as_dict(), handle, indent=2)
        print(f"wrote {args.json_out}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from weightsync_core.compare_benchmark import comparison_table, run_comparison

    kwargs = {}
    for option in args.kwargs:
        name, _, value = option.partition("=")
        kwargs[name] = json.loads(value)
    replicas = tuple(int(size) for size in args.replicas.split(","))
    rows = run_comparison(
        [(name, kwargs.get(name, {})) for name in args.backends], args.actors, replicas,
        args.size_mb, args.bucket_mb, args.tensors, args.repeats, not args.no_verify,
    )
    print(comparison_table(rows, args.actors, replicas))
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump([row.as_dict() for row in rows], handle, indent=2)
        print(f"wrote {args.json_out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``weightsync``."""
    parser = argparse.ArgumentParser(prog="weightsync", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser(
        "backends", help="list every known backend: distribution, installed, loaded or why not"
    )
    backends.add_argument("--no-probe", action="store_true",
                          help="do not import installed backends to check that they load")
    backends.add_argument("--json", action="store_true", help="machine-readable output")
    backends.set_defaults(run=_backends)
    bench = commands.add_parser(
        "bench",
        help="benchmark an engine against its raw transport: gloo (also against the Ray "
        "object store), or a ring backend (nixl, mooncake) to 1 and to N rollout workers",
    )
    bench.add_argument("backend", help="gloo, or an installed ring backend: nixl, mooncake")
    bench.add_argument("--testbed", action="store_true",
                       help="instead: the line-rate matrix on an emulated multi-host cluster "
                       "(needs root and weightsync-testbed; options: weightsync-testbed "
                       "bench --help)")
    bench.add_argument("--size-mb", type=int, default=1024, help="state dict size (MiB)")
    bench.add_argument("--receivers", type=int,
                       help="rollout workers (default: 2 for gloo; 3 for ring backends, "
                       "which are also measured with 1)")
    bench.add_argument("--bucket-mb", type=int,
                       help="bucket size in MiB (default: 256 for gloo, 64 for ring backends)")
    bench.add_argument("--engine-kwargs", default="{}",
                       help='ring backends: engine keyword arguments as JSON, e.g. '
                       '\'{"ucx_transports": "tcp"}\'')
    bench.add_argument("--tensors", type=int, default=64, help="tensors in the state dict")
    bench.add_argument("--repeats", type=int, default=5, help="timed repetitions (median)")
    bench.add_argument("--no-verify", action="store_true", help="turn delivery checks off")
    bench.add_argument("--json-out", help="also write the result as JSON to this file")
    bench.set_defaults(run=_bench)
    compare = commands.add_parser(
        "compare", help="several backends on the same deployment and bytes, in one run"
    )
    compare.add_argument("backends", nargs="+", help="backend names, e.g. kimi mooncake gloo")
    compare.add_argument("--actors", type=int, default=2, help="actor_wg ranks")
    compare.add_argument("--replicas", default="2,2", help="workers per replica, e.g. 2,2")
    compare.add_argument("--size-mb", type=int, default=1024, help="state dict size (MiB)")
    compare.add_argument("--bucket-mb", type=int, default=64, help="bucket size (MiB)")
    compare.add_argument("--tensors", type=int, default=64, help="tensors in the state dict")
    compare.add_argument("--repeats", type=int, default=3, help="timed syncs (median)")
    compare.add_argument("--no-verify", action="store_true", help="turn delivery checks off")
    compare.add_argument("--kwargs", action="append", default=[], metavar="BACKEND=JSON",
                         help="engine keyword arguments of one backend (repeatable)")
    compare.add_argument("--json-out", help="also write the rows as JSON to this file")
    compare.set_defaults(run=_compare)
    return parser


def _bench_on_testbed(argv: list[str]) -> int:
    try:
        from weightsync_testbed.cli import main as testbed_main
    except ImportError:
        print("weightsync bench --testbed needs the testbed: pip install weightsync-testbed",
              file=sys.stderr)
        return 2
    return testbed_main(["bench", *argv])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``weightsync`` command."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["bench"] and "--testbed" in arguments:
        return _bench_on_testbed([a for a in arguments[1:] if a != "--testbed"])
    args = build_parser().parse_args(arguments)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
