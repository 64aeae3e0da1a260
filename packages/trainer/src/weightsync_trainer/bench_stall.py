"""``weightsync-train-bench-stall``: what a sync costs a Hugging Face replica that generates
all the time. A client keeps the replica busy (one request after another) while syncs of a
changing model alternate between staged (phase 1 while it generates, then a ``keep`` pause
for the switch) and stop-the-world (paused for the whole sync), on the same processes in
one run; per mode it prints each sync's stall (the longest wait for a token across it,
beyond the usual gap), its whole time and pause, and the tokens per second during syncs
against those between them."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from collections.abc import Iterator
from typing import Any

import ray
import torch

from weightsync_core import (
    ActorCheckpointEngineMixin,
    CheckpointEngineConfig,
    RayRolloutReplica,
    RayWorkerGroup,
)
from weightsync_core.bench.stall import alternate_syncs, staged_and_stopped, summarize_stalls
from weightsync_trainer.checksum import weights_digest
from weightsync_trainer.config import ModelConfig
from weightsync_trainer.modeling import build_policy_model
from weightsync_trainer.workers.rollout import RolloutWorker

__all__ = ["MODELS", "main", "run_stall_bench"]

MODELS = {
    "tiny": ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2),
    "100m": ModelConfig(vocab_size=31744, hidden_size=640, intermediate_size=1700,
                        num_hidden_layers=12, num_attention_heads=10, num_key_value_heads=10,
                        max_position_embeddings=256),
    "1g": ModelConfig(vocab_size=31744, hidden_size=1536, intermediate_size=4096,
                      num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=12,
                      max_position_embeddings=256),
}
"""Models the bench builds (random weights, no download): ``100m`` has 99.5M parameters,
``1g`` about 1 GiB in bf16."""


class PolicySource(ActorCheckpointEngineMixin):
    """The actor side: a policy model whose weights :meth:`step` changes (use as a Ray
    actor)."""

    def __init__(self, config: CheckpointEngineConfig, model: ModelConfig) -> None:
        torch.set_num_threads(1)
        self.model = build_policy_model(model)
        self.init_checkpoint_engine(config)

    def step(self, seed: int, fraction: float) -> None:
        """Change about ``fraction`` of every parameter's elements (seeded), as an optimizer
        step does."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in self.model.parameters():
                noise = torch.randn(parameter.shape, generator=generator) * 0.02
                if fraction < 1.0:
                    noise *= torch.rand(parameter.shape, generator=generator) < fraction
                parameter.add_(noise)

    def parameters_count(self) -> int:
        """How many parameters the model has."""
        return sum(parameter.numel() for parameter in self.model.parameters())

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, by name."""
        yield from ((name, p.detach()) for name, p in self.model.named_parameters())

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every parameter's shape and dtype, in stream order (what a backend that delivers
        layouts plans with; this source holds every tensor whole)."""
        return {name: (tuple(p.shape), p.dtype) for name, p in self.model.named_parameters()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights, by parameter name."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def checksum(self) -> str:
        """Digest of the weights as a replica serves them (bf16)."""
        return weights_digest((name, p.detach().to(torch.bfloat16))
                              for name, p in self.model.named_parameters())


async def _client(worker: Any, prompt: torch.Tensor, response_length: int,
                  stop: asyncio.Event, times: list[float], spans: list[int]) -> None:
    """One request after another until ``stop``; every token's time into ``times``, and
    into ``spans`` the number of weights versions each response was sampled with."""
    seed = 0
    while not stop.is_set():
        sample = await worker.generate_sample.remote(prompt, response_length, seed)
        times.extend(sample["token_times"])
        spans.append(len(set(sample["versions"])))
        seed += 1


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    model = MODELS[args.model]
    config = CheckpointEngineConfig(
        backend=args.backend, rollout_dtype="bfloat16", delta=args.delta,
        update_weights_bucket_megabytes=args.bucket_mb, sync_timeout_seconds=600)
    source: Any = ray.remote(PolicySource).remote(config, model)
    worker: Any = ray.remote(RolloutWorker).remote(config, model, 1.0, 1)
    replicas = [RayRolloutReplica([worker], name="replica-0")]
    actor_wg = RayWorkerGroup([source])
    managers = staged_and_stopped(config, actor_wg, replicas)
    parameters = await source.parameters_count.remote()
    await managers["staged"].update_weights(global_steps=0)
    prompt = torch.randint(0, model.vocab_size, (1, args.prompt_length))
    stop, times, spans = asyncio.Event(), [], []
    client = asyncio.ensure_future(_client(worker, prompt, args.response_length, stop, times,
                                           spans))
    try:
        windows = await alternate_syncs(
            managers, lambda step: source.step.remote(step, args.changed_fraction),
            args.syncs, args.gap_seconds)
    finally:
        stop.set()
        await client
    summaries, usual_gap, outside_rate = summarize_stalls([times], windows)
    sent, served = await asyncio.gather(source.checksum.remote(),
                                        worker.weights_checksum.remote())
    if sent != served:
        raise RuntimeError("the replica does not serve the actor's last weights")
    return {"model": args.model, "parameters": parameters, "backend": args.backend,
            "delta": args.delta, "usual_gap_seconds": usual_gap,
            "tokens_per_second_outside": outside_rate,
            "responses_spanning_two_versions": sum(1 for n in spans if n > 1),
            "responses": len(spans), "load": os.getloadavg()[0],
            "modes": {mode: vars(summary) for mode, summary in summaries.items()}}


def run_stall_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the bench as ``args`` say (see :func:`main`); return its report."""
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    return asyncio.run(_bench(args))


def _table(report: dict[str, Any]) -> str:
    modes: dict[str, dict[str, Any]] = report["modes"]
    lines = [f"{report['model']} ({report['parameters'] / 1e6:.1f}M parameters, bf16), "
             f"{report['backend']}{', delta' if report['delta'] else ''}; load "
             f"{report['load']:.1f}; usual gap between tokens "
             f"{report['usual_gap_seconds'] * 1e3:.1f} ms; "
             f"{report['tokens_per_second_outside']:.1f} tokens/s between syncs",
             "| mode | syncs | stall, median (max) | sync | pause | tokens/s during syncs |",
             "| --- | --- | --- | --- | --- | --- |"]
    for mode, summary in modes.items():
        pause = (f"{statistics.median(summary['pause_seconds']) * 1e3:.0f} ms"
                 if summary["pause_seconds"] else "the whole sync")
        lines.append(
            f"| {mode} | {summary['syncs']} | "
            f"{statistics.median(summary['stall_seconds']) * 1e3:.0f} ms "
            f"({max(summary['stall_seconds']) * 1e3:.0f} ms) | "
            f"{statistics.median(summary['sync_seconds']) * 1e3:.0f} ms | {pause} | "
            f"{summary['tokens_per_second_during']:.1f} "
            f"({summary['tokens_per_second_during'] / report['tokens_per_second_outside']:.0%}"
            " of between) |")
    if {"staged", "stop-the-world"} <= set(modes):
        staged = statistics.median(modes["staged"]["stall_seconds"])
        stopped = statistics.median(modes["stop-the-world"]["stall_seconds"])
        lines.append(f"staged stall / stop-the-world stall: {staged / stopped:.1%} "
                     "(goal: at most 10%)" if stopped else "")
    lines.append(f"{report['responses_spanning_two_versions']} of {report['responses']} "
                 "responses were sampled with two weights versions (a keep pause)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="weightsync-train-bench-stall", description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="100m")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--delta", action="store_true", help="delta syncs")
    parser.add_argument("--changed-fraction", type=float, default=1.0,
                        help="fraction of each parameter a step changes (default 1.0)")
    parser.add_argument("--syncs", type=int, default=5, help="syncs per mode (default 5)")
    parser.add_argument("--gap-seconds", type=float, default=2.0,
                        help="generation between syncs (default 2 s)")
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    args = parser.parse_args(argv)
    report = run_stall_bench(args)
    print(_table(report))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)



if __name__ == "__main__":
    main()
