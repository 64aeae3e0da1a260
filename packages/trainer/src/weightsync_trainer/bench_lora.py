"""``weightsync-train-bench-lora``: what a LoRA run moves and how fast, in one run.

1. Syncs: the trainer's actor (FSDP2 ranks) and replicas started once with a LoRA policy on
   a model of ``--hidden-size``/``--layers`` (the default: a 134M-parameter Llama), then full
   syncs of the weights (``update_weights``) and adapter syncs (``update_adapter``)
   alternating, ``--rounds`` of each: bytes and seconds of each kind, their ratio, and where
   an adapter sync's time goes (its stages).
2. Rewards (``--steps`` > 0): the toy task trained with full fine-tuning and with the LoRA
   adapter, same seed: reward and sync bytes per step of each, and a PNG of both curves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from weightsync_core import run_sync
from weightsync_trainer.config_loader import load_config
from weightsync_trainer.lora import ADAPTER_NAME
from weightsync_trainer.task_runner import run_and_shut_down
from weightsync_trainer.trainer import RayPPOTrainer

__all__ = ["main", "run_reward_curves", "run_sync_bench"]

Rows = list[dict[str, float]]
_TOPOLOGY = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.num_replicas=2"]


def _model_overrides(hidden: int, layers: int, vocab: int) -> list[str]:
    model = "actor_rollout_ref.model"
    return [f"{model}.hidden_size={hidden}", f"{model}.num_hidden_layers={layers}",
            f"{model}.intermediate_size={hidden * 8 // 3}", f"{model}.vocab_size={vocab}",
            f"{model}.num_attention_heads={hidden // 64}",
            f"{model}.num_key_value_heads={hidden // 64}"]


def _stage_seconds(metrics: dict[str, float]) -> dict[str, float]:
    prefix = "weightsync/seconds/"
    return {key.removeprefix(prefix): value for key, value in metrics.items()
            if key.startswith(prefix) and key != f"{prefix}total"}


def run_sync_bench(overrides: list[str], rounds: int) -> dict[str, Any]:
    """Full and adapter syncs alternating on one trainer's workers; medians and the
    adapter sync's stages (of its median round)."""
    trainer = RayPPOTrainer(load_config(overrides=overrides))
    try:
        run_sync(trainer.init_workers())
        manager = trainer.checkpoint_manager
        if manager is None:
            raise RuntimeError("the trainer started no checkpoint manager")
        full: list[dict[str, float]] = []
        adapter: list[dict[str, float]] = []
        for step in range(1, rounds + 1):
            full.append(manager.update_weights_sync(step))
            adapter.append(manager.update_adapter_sync(step, ADAPTER_NAME))
    finally:
        trainer.shutdown()

    def median(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    full_seconds = median(full, "weightsync/seconds/total")
    adapter_seconds = median(adapter, "weightsync/seconds/total")
    typical = min(adapter, key=lambda row: abs(row["weightsync/seconds/total"]
                                               - adapter_seconds))
    return {"full_bytes": median(full, "weightsync/bytes"),
            "adapter_bytes": median(adapter, "weightsync/bytes"),
            "full_seconds": full_seconds, "adapter_seconds": adapter_seconds,
            "speedup": full_seconds / adapter_seconds,
            "adapter_stages": _stage_seconds(typical), "rounds": rounds,
            "load": os.getloadavg()[0]}


def _run(overrides: list[str]) -> Rows:
    return run_and_shut_down(load_config(overrides=overrides))


def run_reward_curves(lora: list[str], steps: int) -> dict[str, Rows]:
    """The toy task trained ``steps`` steps with full fine-tuning, then with ``lora``'s
    adapter (same seed and topology)."""
    base = [*_TOPOLOGY, "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
            f"trainer.total_training_steps={steps}"]
    return {"full": _run(base), "lora": _run([*base, *lora])}


def _plot(curves: dict[str, Rows], path: Path) -> None:
    figure, (reward_axis, bytes_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, label in (("full", "full fine-tuning"), ("lora", "LoRA adapter")):
        rows = curves[mode]
        steps = [row["step"] for row in rows]
        reward_axis.plot(steps, [row["reward/mean"] for row in rows], label=label)
        bytes_axis.plot(steps, [row["weightsync/bytes"] for row in rows], label=label)
    reward_axis.set(xlabel="step", ylabel="mean reward", title="reward")
    bytes_axis.set(xlabel="step", ylabel="bytes per sync", yscale="log",
                   title="sync bytes per step")
    reward_axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0,
                        help="steps of each reward curve (0: no curves)")
    parser.add_argument("--plot", type=Path, default=Path("lora_rewards.png"))
    parser.add_argument("--json", type=Path, help="write the whole report here")
    args = parser.parse_args(argv)
    targets = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
    lora = ["actor_rollout_ref.model.lora_rank=" + str(args.rank),
            "actor_rollout_ref.model.lora_alpha=" + str(2 * args.rank),
            f"actor_rollout_ref.model.target_modules={targets}"]
    start = time.perf_counter()
    syncs = run_sync_bench(
        [*_TOPOLOGY, f"actor_rollout_ref.rollout.checkpoint_engine.backend={args.backend}",
         *_model_overrides(args.hidden_size, args.layers, args.vocab_size), *lora],
        args.rounds)
    print(f"full sync:    {syncs['full_bytes'] / 1e6:9.1f} MB  "
          f"{syncs['full_seconds']:.3f} s (median of {args.rounds})")
    print(f"adapter sync: {syncs['adapter_bytes'] / 1e6:9.1f} MB  "
          f"{syncs['adapter_seconds']:.3f} s  -> {syncs['speedup']:.1f}x faster, "
          f"{syncs['full_bytes'] / syncs['adapter_bytes']:.0f}x fewer bytes")
    print("adapter sync stages (s):", json.dumps(
        {stage: round(seconds, 4) for stage, seconds in syncs["adapter_stages"].items()}))
    report: dict[str, Any] = {"syncs": syncs}
    if args.steps:
        curves = run_reward_curves(
            ["actor_rollout_ref.model.lora_rank=8",
             "actor_rollout_ref.model.target_modules=[q_proj,v_proj,lm_head]",
             "actor_rollout_ref.actor.optim.lr=0.05"], args.steps)
        for mode, rows in curves.items():
            print(f"{mode:5s} reward per step:", [round(row["reward/mean"], 3) for row in rows])
            print(f"{mode:5s} bytes per sync:  {rows[-1]['weightsync/bytes']:.0f}")
        _plot(curves, args.plot)
        report["curves"] = curves
    print(f"load average {os.getloadavg()[0]:.2f}; {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
