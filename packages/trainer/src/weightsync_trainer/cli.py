"""``weightsync-train``: run the default experiment (or an overridden one) and save results."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import yaml
from tqdm import tqdm

from weightsync_core import PluginError, WeightSyncError, run_sync
from weightsync_trainer.config import ExperimentConfig
from weightsync_trainer.config_loader import config_to_dict, load_config
from weightsync_trainer.errors import ConfigError
from weightsync_trainer.outputs import format_step, plot_metrics, summarize, write_jsonl
from weightsync_trainer.task_runner import TaskRunner

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightsync-train",
        description="Train a tiny Hugging Face model with GRPO/PPO on Ray, syncing weights to "
        "the rollout replicas with a weightsync checkpoint engine every step.",
        epilog="example: weightsync-train rollout.checkpoint_engine.backend=gloo "
        "trainer.total_steps=20",
    )
    parser.add_argument("--config", help="YAML file of overrides of the packaged defaults")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. algorithm.name=ppo")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration and exit")
    return parser


def _output_dir(config: ExperimentConfig) -> Path:
    if config.trainer.output_dir is not None:
        return Path(config.trainer.output_dir)
    return Path("outputs") / time.strftime("%Y%m%d-%H%M%S")


def _start_ray(config: ExperimentConfig) -> None:
    """Connect to ``trainer.ray_address`` (else ``RAY_ADDRESS``), else start a private local
    Ray instance of ``trainer.ray_num_cpus`` CPUs, beside any cluster on the machine.

    Raises:
        ConnectionError: the cluster asked for cannot be reached (a ``HOST:PORT`` that
            refuses or does not answer: within ``weightsync_core.local_ray.CONNECT_SECONDS``).
    """
    from weightsync_core import ensure_ray

    ensure_ray(num_cpus=config.trainer.ray_num_cpus or os.cpu_count() or 1,
               address=config.trainer.ray_address)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``weightsync-train``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"weightsync-train: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
        return 0
    output = _output_dir(config)
    engine = config.rollout.checkpoint_engine
    print(f"weightsync-train: {config.algorithm.name}, backend {engine.backend}, "
          f"{config.actor.world_size} actor ranks, output {output}", flush=True)
    runner = TaskRunner(config)
    total = config.trainer.total_steps
    try:
        # loads the custom backend module and manager class: bad names fail before Ray starts
        runner.trainer = runner.build_trainer()
        try:
            _start_ray(config)
        except ConnectionError as exc:  # the cluster asked for cannot be reached
            print(f"weightsync-train: {exc}", file=sys.stderr)
            return 1
        print("starting workers and syncing the initial weights...", flush=True)
        started = time.perf_counter()
        run_sync(runner.trainer.init_workers())
        print(f"workers ready in {time.perf_counter() - started:.1f} s", flush=True)
        with tqdm(total=total, desc="training", unit="step", dynamic_ncols=True) as bar:

            def on_step(row: dict[str, float]) -> None:
                bar.write(format_step(row, total))
                bar.set_postfix(reward=f"{row['reward/mean']:.3f}",
                                sync_ms=f"{row['weightsync/seconds/total'] * 1e3:.0f}")
                bar.update(1)

            rows = runner.trainer.run(on_step)
        output.mkdir(parents=True, exist_ok=True)
        write_jsonl(output / "metrics.jsonl", rows)
        plot_metrics(output / "metrics.png", rows,
                     f"{config.algorithm.name.upper()} with weightsync backend {engine.backend}")
        runner.trainer.save_weights(str(output / "weights"))
        (output / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config),
                                                           sort_keys=False))
        summary = summarize(rows)
        (output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    except (ConfigError, PluginError, WeightSyncError) as exc:
        print(f"weightsync-train: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if runner.trainer is not None:
            runner.trainer.shutdown()
    print(
        f"reward: first {summary['window']} steps {summary['reward_first']:.3f} -> last "
        f"{summary['window']} steps {summary['reward_last']:.3f}; weight sync "
        f"{summary['sync_seconds_mean'] * 1e3:.1f} ms/step, {summary['sync_gbps_mean']:.3f} GB/s "
        f"({summary['sync_bytes_mean'] / 1e6:.2f} MB sent per sync"
        + (f", {summary['changed_fraction_mean']:.1%} of the elements changed per delta sync"
           if "changed_fraction_mean" in summary else "")
        + ")\n"
        f"wrote {output}/metrics.jsonl, metrics.png, summary.json, config.yaml, "
        "weights/model.safetensors"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
