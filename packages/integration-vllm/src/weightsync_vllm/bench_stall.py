"""``weightsync-vllm-bench-stall``: what a sync costs a vLLM replica (``AsyncLLM``) that
serves all the time. A client sends short requests one after another while syncs of a
changing model alternate between staged (phase 1 while vLLM serves, then a ``keep`` pause
for one reload) and stop-the-world (vLLM paused for the whole sync), on the same processes
in one run. The client's unit is a request (the actor returns whole responses): a sync's
stall is the longest gap between two completed requests across it, beyond the usual gap."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from typing import Any

import ray
import torch
from ray.exceptions import RayTaskError

from weightsync_core import CheckpointEngineConfig, RayWorkerGroup, ensure_ray
from weightsync_core.bench.stall import alternate_syncs, staged_and_stopped, summarize_stalls
from weightsync_vllm.bench import model_shape
from weightsync_vllm.model_source import ModelWeightsSource, save_qwen2
from weightsync_vllm.staged_worker import StagedAsyncVLLMRolloutWorker
from weightsync_vllm.tensor_parallel import StagedVLLMReplica, cpu_threads_bind

__all__ = ["main"]

_RETRY_SECONDS = 0.005
"""How soon the client sends a request again that a paused replica refused."""


async def _client(rollout: Any, prompt: torch.Tensor, tokens: int, stop: asyncio.Event,
                  done: list[float]) -> None:
    """One request after another until ``stop``; each completion's time into ``done``. A
    request refused because the replica is paused for a stop-the-world sync is sent again
    (what a client does: the wait counts in the stall)."""
    seed = 0
    while not stop.is_set():
        try:
            await rollout.generate.remote(prompt, tokens, seed)
        except RayTaskError as error:
            if "paused for a weight sync" not in str(error):
                raise
            await asyncio.sleep(_RETRY_SECONDS)
            continue
        done.append(time.monotonic())
        seed += 1


async def _bench(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    config = CheckpointEngineConfig(backend=args.backend, delta=args.delta,
                                    update_weights_bucket_megabytes=64,
                                    sync_timeout_seconds=600)
    source: Any = ray.remote(num_cpus=0)(ModelWeightsSource).remote(config, model_path)
    tensor_parallel = args.tensor_parallel_size
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if tensor_parallel > 1:  # one share of this host's CPUs per vLLM worker
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(tensor_parallel)
    rollout: Any = ray.remote(num_cpus=0)(StagedAsyncVLLMRolloutWorker).remote(
        config, model_path, {"tensor_parallel_size": tensor_parallel}, temperature=1.0,
        env=env)
    await rollout.start.remote()
    replicas = [StagedVLLMReplica(rollout, tensor_parallel)]
    managers = staged_and_stopped(config, RayWorkerGroup([source]), replicas)
    weights = await source.weights_bytes.remote()
    await managers["staged"].update_weights(0)
    prompt = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    stop, done = asyncio.Event(), []
    client = asyncio.ensure_future(_client(rollout, prompt, args.tokens, stop, done))
    try:
        windows = await alternate_syncs(
            managers, lambda step: source.perturb.remote(step, fraction=args.changed_fraction),
            args.syncs, args.gap_seconds)
    finally:
        stop.set()
        await client
        await rollout.shutdown.remote()
    summaries, usual_gap, rate = summarize_stalls([done], windows)
    return {"bytes": weights, "backend": args.backend, "delta": args.delta,
            "tensor_parallel_size": tensor_parallel,
            "usual_gap_seconds": usual_gap, "requests_per_second_outside": rate,
            "load": os.getloadavg()[0],
            "modes": {mode: vars(summary) for mode, summary in summaries.items()}}


def _table(report: dict[str, Any], tokens: int) -> str:
    lines = [f"vLLM AsyncLLM (tensor_parallel_size {report['tensor_parallel_size']}), "
             f"{report['bytes'] / 2**20:.0f} MiB of float32 weights, "
             f"{report['backend']}{', delta' if report['delta'] else ''}; load "
             f"{report['load']:.1f}; requests of {tokens} tokens, usual gap between two "
             f"completions {report['usual_gap_seconds'] * 1e3:.0f} ms "
             f"({report['requests_per_second_outside']:.1f} requests/s between syncs)",
             "| mode | syncs | stall, median (max) | sync | pause | requests/s during syncs |",
             "| --- | --- | --- | --- | --- | --- |"]
    modes = report["modes"]
    for mode, summary in modes.items():
        pause = (f"{statistics.median(summary['pause_seconds']) * 1e3:.0f} ms"
                 if summary["pause_seconds"] else "the whole sync")
        during = summary["tokens_per_second_during"]
        lines.append(
            f"| {mode} | {summary['syncs']} | "
            f"{statistics.median(summary['stall_seconds']) * 1e3:.0f} ms "
            f"({max(summary['stall_seconds']) * 1e3:.0f} ms) | "
            f"{statistics.median(summary['sync_seconds']) * 1e3:.0f} ms | {pause} | "
            f"{during:.1f} ({during / report['requests_per_second_outside']:.0%} of between) |")
    if {"staged", "stop-the-world"} <= set(modes):
        staged = statistics.median(modes["staged"]["stall_seconds"])
        stopped = statistics.median(modes["stop-the-world"]["stall_seconds"])
        if stopped:
            lines.append(f"staged stall / stop-the-world stall: {staged / stopped:.1%} "
                         "(goal: at most 10%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="weightsync-vllm-bench-stall", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=377,
                        help="float32 weights of the Qwen2 model (default 377: 98.8M "
                        "parameters)")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--delta", action="store_true")
    parser.add_argument("--changed-fraction", type=float, default=1.0)
    parser.add_argument("--syncs", type=int, default=4, help="syncs per mode (default 4)")
    parser.add_argument("--gap-seconds", type=float, default=3.0)
    parser.add_argument("--tokens", type=int, default=4, help="tokens per request")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="vLLM workers of the replica, each a rank of the sync")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ensure_ray(num_cpus=4)
    with tempfile.TemporaryDirectory() as directory:
        model_path = save_qwen2(directory, **model_shape(args.size_mb))
        report = asyncio.run(_bench(args, model_path))
    print(_table(report, args.tokens))


if __name__ == "__main__":
    main()
