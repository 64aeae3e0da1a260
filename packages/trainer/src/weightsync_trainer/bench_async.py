"""``weightsync-train-bench-async``: the same experiment (same config and seed) run
synchronously and with ``trainer.async_rollout.enable=true``, one after the other in one
run; prints steps per second and reward of each and writes a PNG of both reward curves
beside the asynchronous run's staleness histogram."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from weightsync_trainer.config_loader import load_config
from weightsync_trainer.task_runner import run_and_shut_down

__all__ = ["main", "run_async_bench"]

Rows = list[dict[str, float]]


def _run(overrides: list[str]) -> Rows:
    return run_and_shut_down(load_config(overrides=overrides))


def _mean_reward(rows: Rows) -> float:
    return sum(row["reward/mean"] for row in rows) / len(rows)


def _summary(rows: Rows, window: int) -> dict[str, float]:
    seconds = sum(row["timing/step_s"] for row in rows)
    return {"steps": len(rows), "seconds": seconds, "steps_per_second": len(rows) / seconds,
            "reward_first": _mean_reward(rows[:window]),
            "reward_last": _mean_reward(rows[-window:])}


def run_async_bench(overrides: list[str], window: int = 5) -> dict[str, Any]:
    """Both runs of the experiment ``overrides`` describe; their rows and summaries."""
    synchronous = _run(overrides)
    asynchronous = _run([*overrides, "trainer.async_rollout.enable=true"])
    return {"sync": {"rows": synchronous, **_summary(synchronous, window)},
            "async": {"rows": asynchronous, **_summary(asynchronous, window)},
            "load": os.getloadavg()[0]}


def plot(report: dict[str, Any], path: Path) -> None:
    """Reward per step of both runs, and the asynchronous run's staleness histogram."""
    figure, (reward_axis, staleness_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, label in (("sync", "synchronous"), ("async", "asynchronous")):
        rows = report[mode]["rows"]
        reward_axis.plot([row["step"] for row in rows], [row["reward/mean"] for row in rows],
                         marker="o", markersize=3,
                         label=f"{label} ({report[mode]['steps_per_second']:.2f} steps/s)")
    reward_axis.set_xlabel("step")
    reward_axis.set_ylabel("mean reward")
    reward_axis.set_ylim(0, 1.05)
    reward_axis.grid(alpha=0.3)
    reward_axis.legend()
    rows = report["async"]["rows"]
    counts: dict[int, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("async/staleness_") and key.removeprefix(
                    "async/staleness_").isdigit():
                lag = int(key.removeprefix("async/staleness_"))
                counts[lag] = counts.get(lag, 0.0) + value
    staleness_axis.bar([str(lag) for lag in sorted(counts)],
                       [counts[lag] for lag in sorted(counts)])
    staleness_axis.set_xlabel("staleness of a response's oldest token (actor updates)")
    staleness_axis.set_ylabel("responses")
    staleness_axis.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="weightsync-train-bench-async", description=__doc__)
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="Hydra overrides of both runs, e.g. trainer.total_training_steps=30")
    parser.add_argument("--out", default="async-bench", help="folder for the PNG and JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    report = run_async_bench(args.overrides)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(report, out / "async_vs_sync.png")
    (out / "report.json").write_text(json.dumps(report, indent=2))
    for mode in ("sync", "async"):
        entry = report[mode]
        print(f"{mode:5}: {entry['steps']} steps in {entry['seconds']:.1f} s, "
              f"{entry['steps_per_second']:.2f} steps/s, reward {entry['reward_first']:.3f} "
              f"-> {entry['reward_last']:.3f}")
    ratio = report["async"]["steps_per_second"] / report["sync"]["steps_per_second"]
    print(f"async / sync steps per second: {ratio:.2f}x (goal 1.3x); load "
          f"{report['load']:.1f}; plot: {out / 'async_vs_sync.png'}")


if __name__ == "__main__":
    main()
