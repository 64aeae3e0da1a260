"""Shared helpers of the trainer tests."""

from weightsync_trainer import TaskRunner, load_config


def run_experiment(overrides):
    """Run one experiment (defaults plus ``overrides``); returns ``(runner, per-step
    metrics)``. The caller shuts the trainer down."""
    runner = TaskRunner(load_config(overrides=overrides))
    return runner, runner.run()


def mean_reward(rows):
    """Mean of ``reward/mean`` over ``rows``."""
    return sum(row["reward/mean"] for row in rows) / len(rows)
