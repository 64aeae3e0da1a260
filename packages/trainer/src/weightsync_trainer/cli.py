"""``weightsync-train``: run the default experiment (or an overridden one) and save results."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import yaml
from tqdm import tqdm

from weightsync_core import PluginError, WeightSyncError, run_sync
from weightsync_trainer.config import ExperimentConfig
from weightsync_trainer.config_loader import config_to_dict, load_config
from weightsync_trainer.errors import ConfigError

__all__ = ["main"]


ALGORITHM_NAMES = {"grpo": "GRPO", "gae": "PPO"}
"""What the banner and the plot call each ``algorithm.adv_estimator``."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightsync-train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a tiny Hugging Face model with GRPO/PPO on Ray, syncing weights to\n"
        "the rollout replicas with a weightsync checkpoint engine every step.\n\n"
        "The configuration has verl's key paths and is composed by Hydra: the packaged\n"
        "ppo_trainer.yaml, then your YAML file (--config-path/--config-name), then the\n"
        "overrides.",
        epilog="examples:\n"
        "  weightsync-train actor_rollout_ref.rollout.checkpoint_engine.backend=nixl \\\n"
        "                   trainer.total_training_steps=20\n"
        "  weightsync-train algorithm.adv_estimator=gae critic.world_size=2\n"
        "  weightsync-train --config-path conf --config-name my_experiment trainer.seed=3\n"
        "  weightsync-train --print-config \\\n"
        "                   +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.nixl."
        "plugin=UCX",
    )
    parser.add_argument("--config-path", "-cp", metavar="DIR",
                        help="the folder of --config-name (default: the current directory)")
    parser.add_argument("--config-name", "-cn", metavar="NAME",
                        help="a YAML file (NAME.yaml) merged over the packaged defaults, or "
                        "composed from its own defaults list (verl's [ppo_trainer, _self_])")
    parser.add_argument("--config", metavar="FILE", help=argparse.SUPPRESS)  # until 0.8
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="Hydra overrides: key=value, +key=value (add), ++key=value (add "
                        "or change), ~key (delete), e.g. algorithm.adv_estimator=gae")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration and exit")
    return parser


def _load(args: argparse.Namespace) -> ExperimentConfig:
    """The configuration the arguments ask for; each deprecation note is printed once."""
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always", FutureWarning)
        try:
            if args.config is not None:
                warnings.warn(
                    "--config FILE is now --config-path DIR --config-name NAME (Hydra's, as "
                    "verl's); --config works until weightsync-trainer 0.8", FutureWarning,
                    stacklevel=1)
            return load_config(args.config, args.overrides, config_name=args.config_name,
                               config_path=args.config_path)
        finally:
            printed = set()
            for note in notes:
                if not issubclass(note.category, FutureWarning):
                    warnings.showwarning(note.message, note.category, note.filename,
                                         note.lineno)
                elif str(note.message) not in printed:
                    printed.add(str(note.message))
                    print(f"weightsync-train: note: {note.message}", file=sys.stderr)


def _output_dir(config: ExperimentConfig) -> Path:
    if config.trainer.output_dir is not None:
        return Path(config.trainer.output_dir)
    return Path("outputs") / time.strftime("%Y%m%d-%H%M%S")


def _start_ray(config: ExperimentConfig) -> None:
    """Connect to ``trainer.ray_address`` (else ``RAY_ADDRESS``), else start a private local
    Ray instance of ``ray_kwargs.ray_init.num_cpus`` CPUs, beside any cluster on the machine.

    Raises:
        ConnectionError: the cluster asked for cannot be reached (a ``HOST:PORT`` that
            refuses or does not answer: within
            ``weightsync_core.orchestration.local_ray.CONNECT_SECONDS``).
    """
    from weightsync_core import ensure_ray

    ensure_ray(num_cpus=config.ray_kwargs.ray_init.num_cpus or os.cpu_count() or 1,
               address=config.trainer.ray_address)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``weightsync-train``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        config = _load(args)
    except ConfigError as exc:
        print(f"weightsync-train: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
        return 0
    # imported once the configuration is good: a bad one is refused before torch loads
    from weightsync_trainer.outputs import format_step, plot_metrics, summarize, write_jsonl
    from weightsync_trainer.task_runner import TaskRunner

    output = _output_dir(config)
    engine = config.actor_rollout_ref.rollout.checkpoint_engine
    algorithm = ALGORITHM_NAMES.get(config.algorithm.adv_estimator,
                                    config.algorithm.adv_estimator)
    print(f"weightsync-train: {algorithm}, backend {engine.backend}, "
          f"{config.actor_world_size} actor ranks, output {output}", flush=True)
    runner = TaskRunner(config)
    total = config.trainer.total_training_steps
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
        # off a terminal tqdm draws nothing (disable=None), leaving only the step lines
        with tqdm(total=total, desc="training", unit="step", dynamic_ncols=True,
                  disable=None) as bar:

            def on_step(row: dict[str, float]) -> None:
                bar.write(format_step(row, total))
                bar.set_postfix(reward=f"{row['reward/mean']:.3f}",
                                sync_ms=f"{row['weightsync/seconds/total'] * 1e3:.0f}")
                bar.update(1)

            rows = runner.trainer.run(on_step)
        output.mkdir(parents=True, exist_ok=True)
        write_jsonl(output / "metrics.jsonl", rows)
        plot_metrics(output / "metrics.png", rows,
                     f"{algorithm} with weightsync backend {engine.backend}")
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
