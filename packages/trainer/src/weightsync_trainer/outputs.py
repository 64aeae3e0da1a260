"""What a run leaves behind: metrics JSONL, a summary and a plot of reward and sync time."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["format_step", "plot_metrics", "summarize", "write_jsonl"]

Rows = Sequence[dict[str, float]]


def write_jsonl(path: Path, rows: Rows) -> None:
    """One JSON object per step."""
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


def summarize(rows: Rows, window: int = 5) -> dict[str, float]:
    """Mean reward of the first and last ``window`` steps, and mean sync figures (with
    delta sync, the mean fraction of elements changed over the syncs that sent patches)."""
    window = max(1, min(window, len(rows) // 2 or 1))

    def mean(key: str, part: Rows) -> float:
        return sum(row[key] for row in part) / len(part)

    deltas = [row for row in rows if row.get("weightsync/delta") == 1.0]

    return {
        "steps": len(rows),
        "window": window,
        "reward_first": mean("reward/mean", rows[:window]),
        "reward_last": mean("reward/mean", rows[-window:]),
        "sync_seconds_mean": mean("weightsync/seconds/total", rows),
        "sync_gbps_mean": mean("weightsync/gbps", rows),
        "sync_bytes": rows[-1]["weightsync/bytes"],
        "sync_bytes_mean": mean("weightsync/bytes", rows),
        **({"changed_fraction_mean": mean("weightsync/changed_fraction", deltas)}
           if deltas else {}),
        "step_seconds_mean": mean("timing/step_s", rows),
    }


def format_step(row: dict[str, float], total_steps: int) -> str:
    """The line printed after each step: reward, sync time and rates, bytes sent and, with
    delta sync on, whether the sync sent deltas and the fraction of elements that changed."""
    delta = ""
    if "weightsync/delta" in row:
        kind = "delta" if row["weightsync/delta"] else "full"
        delta = f" ({kind}, {row['weightsync/changed_fraction']:.1%} changed)"
    return (
        f"step {int(row['step']):>3}/{total_steps}  reward {row['reward/mean']:.3f}  "
        f"sync {row['weightsync/seconds/total'] * 1e3:7.1f} ms  "
        f"{row['weightsync/bytes'] / 1e6:.2f} MB{delta}  "
        f"{row['weightsync/gbps']:.3f} GB/s  "
        f"(transfer {row['weightsync/transfer_gbps']:.3f} GB/s)  step {row['timing/step_s']:.2f} s"
    )


def plot_metrics(path: Path, rows: Rows, title: str) -> None:
    """Reward and sync time per step, one panel each, saved as PNG."""
    steps = [row["step"] for row in rows]
    figure, (reward_axis, sync_axis) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    reward_axis.plot(steps, [row["reward/mean"] for row in rows], marker="o", markersize=3)
    reward_axis.set_ylabel("mean reward")
    reward_axis.set_ylim(0, 1.05)
    reward_axis.grid(alpha=0.3)
    sync_axis.plot(steps, [row["weightsync/seconds/total"] * 1e3 for row in rows],
                   marker="o", markersize=3, color="tab:orange")
    sync_axis.set_ylabel("weight sync (ms)")
    sync_axis.set_xlabel("step")
    sync_axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
