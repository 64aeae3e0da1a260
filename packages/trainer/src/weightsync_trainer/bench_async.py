"""``weightsync-train-bench-async``: the same experiment (same config and seed) run
synchronously and with ``trainer.async_rollout.enable=true``, one after the other in one
run; prints steps per second and reward of each and writes a PNG of both reward curves
beside the asynchronous run's staleness histogram.

With ``--rounds N`` the pair runs N times, in alternating order (sync then async, then async
then sync, ...): on a shared machine the speed drifts within a minute (the synchronous
run's generation took 116 ms a step in one run and 201 ms in the next, ten minutes apart),
and a pair run in one order only charges the drift to one side. The ratio reported is of
the steps per second summed over the rounds."""

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


def run_async_bench(overrides: list[str], window: int = 5, rounds: int = 1
                    ) -> dict[str, Any]:
    """Both runs of the experiment ``overrides`` describe, ``rounds`` times in alternating
    order: the first round's rows and summaries (``"sync"``, ``"async"``), each round's
    steps per second and load (``"rounds"``) and the ratio over all rounds
    (``"ratio"``: asynchronous steps per second over synchronous, each summed)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    modes = {"sync": overrides, "async": [*overrides, "trainer.async_rollout.enable=true"]}
    report: dict[str, Any] = {"rounds": []}
    for index in range(rounds):
        order = ("sync", "async") if index % 2 == 0 else ("async", "sync")
        summaries: dict[str, Any] = {}
        for mode in order:
            rows = _run(modes[mode])
            summaries[mode] = _summary(rows, window)
            if index == 0:
                report[mode] = {"rows": rows, **summaries[mode]}
        report["rounds"].append({
            "order": list(order), "load": os.getloadavg()[0],
            **{f"{mode}_steps_per_second": summaries[mode]["steps_per_second"]
               for mode in modes}})
    report["ratio"] = (sum(entry["async_steps_per_second"] for entry in report["rounds"])
                       / sum(entry["sync_steps_per_second"] for entry in report["rounds"]))
    report["load"] = max(entry["load"] for entry in report["rounds"])
    return report


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
    parser.add_argument("--rounds", type=int, default=1,
                        help="pairs of runs, in alternating order (the first round's curves "
                             "are plotted)")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    report = run_async_bench(args.overrides, rounds=args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(report, out / "async_vs_sync.png")
    (out / "report.json").write_text(json.dumps(report, indent=2))
    for mode in ("sync", "async"):
        entry = report[mode]
        print(f"{mode:5}: {entry['steps']} steps in {entry['seconds']:.1f} s, "
              f"{entry['steps_per_second']:.2f} steps/s, reward {entry['reward_first']:.3f} "
              f"-> {entry['reward_last']:.3f}")
    for index, entry in enumerate(report["rounds"]):
        print(f"round {index + 1} ({' then '.join(entry['order'])}): sync "
              f"{entry['sync_steps_per_second']:.2f}, async {entry['async_steps_per_second']:.2f}"
              f" steps/s, {entry['async_steps_per_second'] / entry['sync_steps_per_second']:.2f}x;"
              f" load {entry['load']:.1f}")
    print(f"async / sync steps per second: {report['ratio']:.2f}x over {len(report['rounds'])} "
          f"round(s) (goal 1.3x); load up to {report['load']:.1f}; plot: "
          f"{out / 'async_vs_sync.png'}")


if __name__ == "__main__":
    main()
