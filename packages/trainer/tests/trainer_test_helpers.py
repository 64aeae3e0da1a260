"""Shared helpers of the trainer tests."""

from weightsync_trainer import TaskRunner, load_config

SMALL = [
    "trainer.prompts_per_step=8",
    "algorithm.group_size=8",
    "rollout.checkpoint_engine.sync_timeout_seconds=60",
]


def run_experiment(overrides, runner_cls=TaskRunner):
    """Run one experiment; returns ``(runner, per-step metrics)``. The caller shuts the trainer
    down."""
    runner = runner_cls(load_config(overrides=[*SMALL, *overrides]))
    return runner, runner.run()


def mean_reward(rows):
    return sum(row["reward/mean"] for row in rows) / len(rows)
