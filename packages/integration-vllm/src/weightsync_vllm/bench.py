"""``weightsync-vllm-bench``: a sync into a vLLM replica through weightsync, against what
users do without it (the trainer writes safetensors, vLLM reloads them from disk), timed in
one run, alternating."""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict, cast

import ray
from ray.actor import ActorHandle

from weightsync_core import (
    CheckpointEngineConfig,
    CheckpointEngineManager,
    RayRolloutReplica,
    RayWorkerGroup,
    ensure_ray,
)
from weightsync_core.bench.measure import (
    Measurement,
    bench_config,
    median_seconds,
    method_rows,
    sync_seconds,
)
from weightsync_vllm.model_source import ModelWeightsSource, save_qwen2
from weightsync_vllm.worker import VLLMRolloutWorker

__all__ = ["disk_reload_seconds", "main", "model_shape", "report", "run"]

_MIB = 1 << 20


class Qwen2Shape(TypedDict):
    """The dimensions :func:`~weightsync_vllm.model_source.save_qwen2` takes."""

    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int


def model_shape(size_mb: int) -> Qwen2Shape:
    """Qwen2 dimensions (hidden 1024, 16 heads, vocab 16384) with enough layers for at least
    ``size_mb`` MiB of float32 weights (and at least two layers)."""
    hidden, vocab, intermediate = 1024, 16384, 2816
    embeddings = 2 * vocab * hidden * 4
    per_layer = (2 * hidden * hidden + 2 * hidden * 64 + 3 * hidden * intermediate) * 4
    layers = max(2, math.ceil((size_mb * _MIB - embeddings) / per_layer))
    return {"hidden_size": hidden, "vocab_size": vocab, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": 16}


def disk_reload_seconds(source: ActorHandle, rollout: ActorHandle, directory: str) -> Measurement:
    """A measurement of the baseline: ``source`` writes its weights as safetensors into
    ``directory``, then ``rollout`` reloads them with vLLM's ``reload_weights``."""

    def measure(step: int) -> dict[str, float]:
        start = time.perf_counter()
        ray.get(source.save_safetensors.remote(directory))
        written = time.perf_counter()
        ray.get(rollout.reload_from_disk.remote(directory))
        done = time.perf_counter()
        return {"disk write": written - start, "disk reload": done - written,
                "disk total": done - start}

    return measure


def run(backends: Sequence[str], size_mb: int, bucket_mb: int, repeats: int,
        engine_kwargs: Mapping[str, Mapping[str, object]] | None = None) -> dict[str, float]:
    """Median seconds of a sync into one vLLM replica over each of ``backends`` and of the
    disk baseline, alternating over ``repeats`` rounds after a warm-up; with ``bytes``."""
    ensure_ray(num_cpus=4)
    with tempfile.TemporaryDirectory(prefix="weightsync-vllm-bench-") as workdir:
        model_path = save_qwen2(f"{workdir}/model", **model_shape(size_mb))
        configs = {name: bench_config(name, (engine_kwargs or {}).get(name, {}), bucket_mb)
                   for name in backends}
        first = configs[backends[0]]
        rollout = _spawn(VLLMRolloutWorker, first, model_path,
                         env={"VLLM_CPU_KVCACHE_SPACE": "1"})
        sources = {name: _spawn(ModelWeightsSource, config, model_path)
                   for name, config in configs.items()}
        try:
            ray.get([rollout.__ray_ready__.remote(),
                     *(source.__ray_ready__.remote() for source in sources.values())])
            # a handle's remote methods are typed Never, so ray.get() cannot say what returns
            nbytes = cast(int, ray.get(sources[backends[0]].weights_bytes.remote()))
            disk = Path(workdir) / "disk"
            disk.mkdir()
            measurements = [_over(name, configs[name], sources[name], rollout)
                            for name in backends]
            measurements.append(disk_reload_seconds(sources[backends[0]], rollout, str(disk)))
            return {**median_seconds(measurements, repeats), "bytes": nbytes}
        finally:
            ray.get(rollout.shutdown.remote())
            for actor in (rollout, *sources.values()):
                ray.kill(actor)


def _spawn(cls: type, *args: Any, **kwargs: Any) -> ActorHandle:
    """An actor of ``cls`` taking no CPU of Ray's (ray types ``.remote()`` as the handle or
    the class itself; it is the handle)."""
    return cast(ActorHandle, ray.remote(num_cpus=0)(cls).remote(*args, **kwargs))


def _over(name: str, config: CheckpointEngineConfig, source: ActorHandle,
          rollout: ActorHandle) -> Measurement:
    """One weightsync sync over backend ``name`` (the replica's engine switched to it)."""
    manager = CheckpointEngineManager(config, RayWorkerGroup([source]),
                                      [RayRolloutReplica([rollout])])
    timed = sync_seconds(manager, **{f"weightsync {name}": "total"})

    def measure(step: int) -> Mapping[str, float]:
        ray.get(rollout.set_checkpoint_engine.remote(config))
        figures = dict(timed(step))
        stats = cast(dict[str, float], ray.get(rollout.last_update_stats.remote()))
        load = stats["load_seconds"] + stats["finish_seconds"]
        figures[f"  of which vLLM load ({name})"] = load
        figures[f"  of which the rest ({name})"] = figures[f"weightsync {name}"] - load
        return figures

    return measure


def report(figures: Mapping[str, float]) -> list[str]:
    """The result table, each weightsync row with its speed-up over the disk baseline."""
    nbytes = int(figures["bytes"])
    rows = [(name, seconds) for name, seconds in figures.items() if name != "bytes"]
    lines = method_rows(rows, nbytes, 24)
    baseline = figures["disk total"]
    lines += [f"{name}: {baseline / seconds:.1f}x faster than disk write + reload"
              for name, seconds in rows if name.startswith("weightsync")]
    return [f"model: {nbytes / _MIB:.0f} MiB float32", *lines]


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", nargs="+", default=["gloo"],
                        help="weightsync backends to time (default: gloo); each switch "
                             "rebuilds the replica's engine, so time one per run for "
                             "figures without set-up")
    parser.add_argument("--size-mb", type=int, default=256,
                        help="model size in MiB (float32; default 256)")
    parser.add_argument("--bucket-mb", type=int, default=64, help="bucket size in MiB")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median)")
    args = parser.parse_args(argv)
    figures = run(args.backend, args.size_mb, args.bucket_mb, args.repeats)
    print("\n".join(report(figures)))
