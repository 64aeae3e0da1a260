"""Asynchronous RL end to end (trainer.async_rollout): the replica generates the next batch
while the actor trains and the new weights are staged; every batch is within max_staleness
of the actor that trains on it (and one update old from the second step on: rollout really
ran ahead), decoupled PPO's importance weights are applied, the reward rises, and the
replica ends on exactly the actor's weights."""

import pytest
from trainer_test_helpers import mean_reward, run_experiment

from weightsync_trainer import load_config
from weightsync_trainer.errors import ConfigError

STEPS = 10
ASYNC = ["trainer.async_rollout.enable=true", "trainer.n_gpus_per_node=1",
         "actor_rollout_ref.rollout.num_replicas=1",
         "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
         f"trainer.total_training_steps={STEPS}"]


@pytest.fixture(scope="module")
def async_run():
    runner, rows = run_experiment(ASYNC)
    checksums = runner.trainer.weights_checksums()
    runner.trainer.shutdown()
    return rows, checksums


def test_rollout_runs_one_update_ahead_and_the_replica_ends_exact(async_run):
    rows, checksums = async_run
    assert checksums["rollout"] == [checksums["actor"]]
    assert rows[0]["async/staleness_max"] == 0.0  # the first batch: the initial weights
    for row in rows[1:]:
        assert row["async/staleness_max"] == 1.0, row  # sampled while the last step trained
        responses = row["async/staleness_0"] + row["async/staleness_1"]
        assert responses == 64 and row["async/staleness_1"] > 0, row
    for row in rows:
        assert row["weightsync/staged"] == 1.0
        assert row["actor/is_weight_mean"] > 0.0 and row["actor/is_weight_max"] <= 2.0


def test_the_reward_rises_under_staleness(async_run):
    rows, _ = async_run
    first, last = mean_reward(rows[:3]), mean_reward(rows[-3:])
    assert last > first + 0.3, f"reward did not rise: first {first:.3f}, last {last:.3f}"


def test_async_rollout_with_the_colocated_backend_is_refused():
    with pytest.raises(ConfigError, match="needs rollout replicas of their own"):
        load_config(overrides=["trainer.async_rollout.enable=true",
                               "actor_rollout_ref.rollout.checkpoint_engine.backend=naive"])
