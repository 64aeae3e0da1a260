"""The ``weightsync`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from weightsync_core.api.registry import CheckpointEngineRegistry

if TYPE_CHECKING:
    from weightsync_core.plan import Link

__all__ = ["BENCH_ENTRY_POINTS", "main"]

_DESCRIPTION = (
    "weightsync: list the checkpoint-engine backends installed here, benchmark and compare "
    "them, and plan which one syncs a model fastest on a cluster. Help of a command: "
    "weightsync COMMAND --help. Documentation: see the docs."
)
"""What ``weightsync --help`` says (plain text: argparse prints it as it is)."""


def _number_type(
    convert: Callable[[str], float], test: Callable[[float], bool], wanted: str
) -> Callable[[str], float]:
    """An argparse ``type``: ``convert`` the text, refused unless ``test`` holds; argparse
    prints the refusal as ``argument --FLAG: must be WANTED, got 'TEXT'`` (exit status 2)."""

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not test(value):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value

    return parse


_count = _number_type(int, lambda value: value >= 1, "an integer >= 1")
_positive = _number_type(float, lambda value: value > 0, "a number > 0")
_non_negative = _number_type(float, lambda value: value >= 0, "a number >= 0")
_fraction = _number_type(float, lambda value: 0 <= value <= 1, "a number from 0 to 1")


def _counts(text: str) -> tuple[int, ...]:
    """An argparse ``type``: comma-separated integers >= 1, e.g. ``2,2``."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"must be integers >= 1 separated by commas (e.g. 2,2), got {text!r}")
    return values


def _json_object(text: str) -> dict[str, object]:
    """An argparse ``type``: a JSON object, e.g. ``{"ucx_transports": "tcp"}``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _backend_kwargs(text: str) -> tuple[str, dict[str, object]]:
    """An argparse ``type``: ``BACKEND=JSON``, the JSON an object of keyword arguments."""
    name, equals, value = text.partition("=")
    try:
        kwargs = json.loads(value) if name and equals else None
    except json.JSONDecodeError:
        kwargs = None
    if not isinstance(kwargs, dict):
        raise argparse.ArgumentTypeError(
            f'must be BACKEND=JSON object, e.g. nixl=\'{{"ucx_transports": "tcp"}}\'; got {text!r}')
    return name, kwargs


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


def _connect(command: str, address: str | None) -> bool:
    """Ray for ``command``: the cluster at ``address`` (default: ``RAY_ADDRESS``), else a
    private local instance; ``False``, after a one-line error, if that cluster cannot be
    reached (within :data:`~weightsync_core.orchestration.local_ray.CONNECT_SECONDS` for
    ``HOST:PORT``)."""
    from weightsync_core.orchestration.local_ray import ensure_ray

    try:
        ensure_ray(address=address)
    except ConnectionError as exc:
        print(f"weightsync {command}: {exc}", file=sys.stderr)
        return False
    return True


_BENCH_BACKENDS = "gloo, or an installed ring backend: nixl, mooncake"


def _bench(args: argparse.Namespace) -> int:
    if args.backend is None:  # --testbed never gets here: main hands it to the testbed
        args.refuse(f"a backend is required: {_BENCH_BACKENDS} (or --testbed, which measures "
                    "every installed CPU backend unless given some)")  # exits: status 2
        return 2
    common = {"size_megabytes": args.size_mb, "num_tensors": args.tensors,
              "repeats": args.repeats, "verify": not args.no_verify}
    if args.quantization:
        from weightsync_core.bench.quantized import run_quantized_benchmark

        if not _connect("bench", args.address):
            return 1
        result = run_quantized_benchmark(
            args.backend, args.engine_kwargs, args.size_mb, args.tensors, args.repeats,
            args.bucket_mb or 64, args.learning_rate,
        )
    elif args.delta:
        from weightsync_core.bench.delta import run_delta_benchmark

        if not _connect("bench", args.address):
            return 1
        result = run_delta_benchmark(
            args.backend, args.engine_kwargs, args.size_mb, args.tensors,
            args.repeats, args.bucket_mb or 64, args.learning_rate,
        )
    elif args.backend == "gloo":
        from weightsync_core.bench.gloo import run_gloo_benchmark

        if not _connect("bench", args.address):
            return 1
        result = run_gloo_benchmark(
            receivers=args.receivers or 2, bucket_megabytes=args.bucket_mb or 256, **common
        )
    else:
        from weightsync_core.bench.ring import run_ring_benchmark
        from weightsync_core.engines.ring import RingCheckpointEngine

        if not issubclass(CheckpointEngineRegistry.get(args.backend), RingCheckpointEngine):
            print(f"weightsync bench: {args.backend!r} is neither gloo nor a ring backend "
                  "(nixl, mooncake); compare it with others: weightsync compare "
                  f"{args.backend} gloo", file=sys.stderr)
            return 2
        if not _connect("bench", args.address):
            return 1
        result = run_ring_benchmark(
            args.backend, args.engine_kwargs, receivers=args.receivers or 3,
            bucket_megabytes=args.bucket_mb or 64, **common,
        )
    print(result.table())
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(result.as_dict(), handle, indent=2)
        print(f"wrote {args.json_out}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from weightsync_core.bench.compare import comparison_table, run_comparison

    kwargs = dict(args.kwargs)
    replicas = args.replicas
    if not _connect("compare", args.address):
        return 1
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


def _plan(args: argparse.Namespace) -> int:
    try:
        nic, intra = _plan_links(args)
        return _print_plan(args, nic, intra)
    except ValueError as exc:
        print(f"weightsync plan: {exc}", file=sys.stderr)
        return 2
    except ConnectionError as exc:  # --measure: the cluster cannot be reached
        print(f"weightsync plan: {exc}", file=sys.stderr)
        return 1


def _plan_links(args: argparse.Namespace) -> tuple[Link, Link]:
    """NIC and intra-host links from the options, or probed (``--measure``)."""
    from weightsync_core.plan import Link

    nic = Link(args.nic_gbit * 1e9 / 8, args.nic_latency_us * 1e-6)
    intra = Link(args.intra_gbyte * 1e9, args.intra_latency_us * 1e-6)
    if not args.measure:
        return nic, intra
    from weightsync_core.orchestration.local_ray import ensure_ray
    from weightsync_core.plan.probe import measure_cluster_links

    ensure_ray(address=args.address)
    nic, loopback = measure_cluster_links()
    print(f"measured: NIC {nic.bandwidth * 8 / 1e9:.3f} Gbit/s, {nic.latency * 1e6:.0f} us"
          f"; loopback {loopback.bandwidth / 1e9:.2f} GB/s"
          + ("" if args.device == "cpu" else " (not used: --intra-* give the device link)"))
    return nic, (loopback if args.device == "cpu" else intra)


def _plan_model(args: argparse.Namespace) -> tuple[int, float, bool]:
    """The bytes a sync moves (patches' bytes with ``--changed-fraction``), the fraction of
    them every worker of a replica needs whole, and whether to predict sharded delivery."""
    from weightsync_core.plan.moe import MOE_MODELS, delta_wire_fraction

    if args.moe is None:
        if args.model_gb is None:
            raise ValueError("give --model-gb (the bytes to sync) or --moe (a published model)")
        if args.expert_parallel:
            raise ValueError("--expert-parallel needs --moe (the model whose experts split)")
        model_bytes, fraction, sharded, element = (int(args.model_gb * 1e9),
                                                   args.replicated_fraction, args.sharded, 2)
    else:
        if args.model_gb is not None:
            raise ValueError(f"--moe {args.moe} gives the model's bytes: leave out --model-gb")
        model = MOE_MODELS[args.moe]
        model_bytes = model.model_bytes
        fraction = model.replicated_fraction(args.workers_per_replica, args.expert_parallel)
        sharded, element = True, max(1, round(model.bytes_per_param))
    if args.changed_fraction is not None:
        model_bytes = math.ceil(model_bytes * delta_wire_fraction(args.changed_fraction,
                                                                  element))
    return model_bytes, fraction, sharded


def _print_plan(args: argparse.Namespace, nic: Link, intra: Link) -> int:
    from weightsync_core.plan import Cluster, Workload, plan, plan_table, sharded_plan

    cluster = Cluster(
        nic, intra, actor_hosts=args.actor_hosts, actor_ranks_per_host=args.actor_ranks_per_host,
        replicas=args.replicas, workers_per_replica=args.workers_per_replica,
        rollout_workers_per_host=args.rollout_workers_per_host, nics_per_host=args.nics_per_host,
    )
    model_bytes, replicated_fraction, sharded = _plan_model(args)
    if args.largest_tensor_mb * 2**20 > model_bytes:
        what = (f"--model-gb {args.model_gb:g} (GB)" if args.moe is None else
                f"--moe {args.moe}'s {model_bytes / 1e9:g} GB")
        raise ValueError(f"--largest-tensor-mb {args.largest_tensor_mb:g} (MiB) cannot exceed "
                         f"{what}")
    workload = Workload(max(1, model_bytes), args.bucket_mb << 20,
                        int(args.largest_tensor_mb * 2**20), args.pipeline_depth)
    ranked = plan(cluster, workload, args.device, args.backends or None)
    sharded = (sharded_plan(cluster, workload, args.device, replicated_fraction)
               if sharded else None)
    if args.json:
        rows = [{**dataclasses.asdict(item.prediction), "engine_kwargs": item.engine_kwargs}
                for item in ranked]
        if sharded is not None:
            rows.append({**dataclasses.asdict(sharded), "engine_kwargs": None})
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{workload.model_bytes / 1e9:g} GB from {cluster.actor_ranks} actor ranks on "
          f"{cluster.actor_hosts} host(s) to {cluster.replicas} replica(s) of "
          f"{cluster.workers_per_replica} worker(s) on {cluster.rollout_hosts} host(s); "
          f"{workload.buckets} buckets of {args.bucket_mb} MiB; each rollout worker needs "
          f"{workload.receiver_memory_bytes / 2**30:.1f} GiB for buffers")
    print(plan_table(ranked))
    best = ranked[0]
    print(f"recommended: {best.prediction.backend} ({best.prediction.option}), "
          f"bound by {best.prediction.bound}")
    if sharded is not None:
        print(f"{sharded.option} (each rollout worker its shard from every actor rank; "
              f"nixl_sharded / mooncake_sharded write it, gloo_sharded sends it over gloo): "
              f"{sharded.seconds:.2f} s, "
              f"bound by {sharded.bound}; " + _against(best.prediction.seconds, sharded.seconds))
    return 0


def _against(recommended: float, sharded: float) -> str:
    """How sharded delivery's time compares with the recommended option's."""
    if sharded <= recommended:
        return f"{recommended / sharded:.1f}x faster than the recommended"
    return f"{sharded / recommended:.1f}x slower than the recommended"


_ADDRESS_HELP = (
    "Ray cluster to connect to: HOST:PORT (one that refuses or cannot be reached fails in "
    "seconds), or auto (the one 'ray start' started on this machine); default: RAY_ADDRESS, "
    "else a private local instance beside any cluster running on the machine"
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``weightsync``."""
    parser = argparse.ArgumentParser(prog="weightsync", description=_DESCRIPTION)
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
    bench.add_argument("backend", nargs="?",
                       help=f"{_BENCH_BACKENDS}; required without --testbed (with --testbed: "
                       "any number of backends to measure, default every installed CPU one)")
    bench.add_argument("--testbed", action="store_true",
                       help="instead: the line-rate matrix on an emulated multi-host cluster "
                       "(needs root and weightsync-testbed; its options: weightsync-testbed "
                       "bench --help)")
    bench.add_argument("--size-mb", type=_count, default=1024, help="state dict size (MiB)")
    bench.add_argument("--receivers", type=_count,
                       help="rollout workers (default: 2 for gloo; 3 for ring backends, "
                       "which are also measured with 1)")
    bench.add_argument("--bucket-mb", type=_count,
                       help="bucket size in MiB (default: 256 for gloo, 64 for ring backends)")
    bench.add_argument("--engine-kwargs", type=_json_object, default="{}",
                       help='ring backends: engine keyword arguments as JSON, e.g. '
                       '\'{"ucx_transports": "tcp"}\'')
    bench.add_argument("--tensors", type=_count, default=64, help="tensors in the state dict")
    bench.add_argument("--repeats", type=_count, default=5, help="timed repetitions (median)")
    bench.add_argument("--no-verify", action="store_true", help="turn delivery checks off")
    bench.add_argument("--delta", action="store_true",
                       help="full against delta syncs (config.delta) of bf16 weights after "
                       "an optimizer step of fp32 masters, to one rollout worker")
    bench.add_argument("--quantization", action="store_true",
                       help="bf16 against fp8_block syncs (config.rollout_quantization) of "
                       "fp32 masters, and fp8_block delta syncs after optimizer steps, to one "
                       "rollout worker; and what quantizing costs per GiB here")
    bench.add_argument("--learning-rate", type=_positive, default=1.6e-5,
                       help="--delta, --quantization: each step's move per master element "
                       "(1.6e-5 changes about 2%% of the bf16 elements)")
    bench.add_argument("--json-out", help="also write the result as JSON to this file")
    bench.add_argument("--address", help=_ADDRESS_HELP)
    bench.set_defaults(run=_bench, refuse=bench.error)
    compare = commands.add_parser(
        "compare", help="several backends on the same deployment and bytes, in one run"
    )
    compare.add_argument("backends", nargs="+", help="backend names, e.g. kimi mooncake gloo")
    compare.add_argument("--actors", type=_count, default=2, help="actor_wg ranks")
    compare.add_argument("--replicas", type=_counts, default="2,2",
                         help="workers per replica, e.g. 2,2")
    compare.add_argument("--size-mb", type=_count, default=1024, help="state dict size (MiB)")
    compare.add_argument("--bucket-mb", type=_count, default=64, help="bucket size (MiB)")
    compare.add_argument("--tensors", type=_count, default=64, help="tensors in the state dict")
    compare.add_argument("--repeats", type=_count, default=3, help="timed syncs (median)")
    compare.add_argument("--no-verify", action="store_true", help="turn delivery checks off")
    compare.add_argument("--kwargs", type=_backend_kwargs, action="append", default=[],
                         metavar="BACKEND=JSON",
                         help="engine keyword arguments of one backend (repeatable)")
    compare.add_argument("--json-out", help="also write the rows as JSON to this file")
    compare.add_argument("--address", help=_ADDRESS_HELP)
    compare.set_defaults(run=_compare)
    _add_plan_parser(commands)
    return parser


def _add_plan_parser(commands: argparse._SubParsersAction) -> None:
    from weightsync_core.plan.moe import MOE_MODELS

    plan = commands.add_parser(
        "plan", help="predict every backend's sync time on a described cluster, ranked, "
        "with what bounds each (a cost model; see the docs)"
    )
    plan.add_argument("backends", nargs="*", help="backends to plan (default: all for --device)")
    plan.add_argument("--device", choices=("cpu", "gpu", "npu"), default="cpu",
                      help="buckets in host memory over TCP (measured engine costs), or on "
                      "CUDA GPUs / Ascend NPUs over RDMA (assumed engine costs)")
    plan.add_argument("--model-gb", type=_positive,
                      help="bytes to sync (GB); required unless --moe names the model")
    plan.add_argument("--moe", choices=sorted(MOE_MODELS),
                      help="a published mixture of experts (its bytes from its config): "
                      "implies --sharded, its replicated fraction from how vLLM splits it "
                      "over --workers-per-replica")
    plan.add_argument("--expert-parallel", action="store_true",
                      help="with --moe: each worker holds whole experts (vLLM's "
                      "enable_expert_parallel) instead of a slice of every expert")
    plan.add_argument("--changed-fraction", type=_fraction,
                      help="delta syncs: this fraction of the elements changed since the last "
                      "sync; every option moves patches instead (the bytes only: diffing and "
                      "applying are not modelled)")
    plan.add_argument("--largest-tensor-mb", type=_non_negative, default=0.0,
                      help="largest tensor (MiB): sets the receivers' merge memory")
    plan.add_argument("--bucket-mb", type=_count, default=1024, help="bucket size (MiB)")
    plan.add_argument("--pipeline-depth", type=_count, default=2, help="buckets in flight")
    plan.add_argument("--actor-hosts", type=_count, default=1)
    plan.add_argument("--actor-ranks-per-host", type=_count, default=1)
    plan.add_argument("--replicas", type=_count, default=1)
    plan.add_argument("--workers-per-replica", type=_count, default=1)
    plan.add_argument("--rollout-workers-per-host", type=_count, default=1)
    plan.add_argument("--nics-per-host", type=_count, default=1,
                      help="NICs of --nic-gbit on every host (GPU hosts: often one a GPU); "
                      "each process uses one")
    plan.add_argument("--sharded", action="store_true",
                      help="also predict sharded delivery: each rollout worker receives only "
                      "its shard (its replica's workers split the model), from every actor "
                      "rank at once, priced as a point-to-point engine on --device")
    plan.add_argument("--replicated-fraction", type=_fraction, default=0.0,
                      help="with --sharded: the fraction of the model every worker of a "
                      "replica needs whole (norms, replicated KV heads)")
    plan.add_argument("--nic-gbit", type=_positive, default=100.0,
                      help="every host's NIC: payload rate, Gbit/s each direction")
    plan.add_argument("--nic-latency-us", type=_non_negative, default=10.0)
    plan.add_argument("--intra-gbyte", type=_positive, default=10.0,
                      help="between processes of one host: GB/s (NVLink: e.g. 450)")
    plan.add_argument("--intra-latency-us", type=_non_negative, default=2.0)
    plan.add_argument("--measure", action="store_true",
                      help="probe the NIC and intra-host figures of the Ray cluster at "
                      "--address instead of --nic-*/--intra-* (TCP between two nodes)")
    plan.add_argument("--address", help=f"{_ADDRESS_HELP}; --measure only (a private "
                      "instance is one node: no NIC to probe)")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(run=_plan)


BENCH_ENTRY_POINTS = "weightsync.bench"
"""Entry-point group of benchmarks other packages add to ``weightsync bench``: name ``X``
is ``weightsync bench --X ARGS``, its value a function taking ``ARGS`` and returning the
exit status (``weightsync-testbed`` provides ``testbed``)."""


def _bench_from_entry_point(name: str, argv: list[str]) -> int:
    found = importlib.metadata.entry_points(group=BENCH_ENTRY_POINTS, name=name)
    if not found:
        print(f"weightsync bench --{name} needs the package that provides it: pip install "
              f"weightsync-{name}", file=sys.stderr)
        return 2
    run: Callable[[list[str]], int] = next(iter(found)).load()
    return run(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``weightsync`` command."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["bench"] and "--testbed" in arguments:
        return _bench_from_entry_point(
            "testbed", [a for a in arguments[1:] if a != "--testbed"])
    args = build_parser().parse_args(arguments)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
