"""End to end: 2 actor ranks (FSDP2), 2 rollout replicas, GRPO. The reward rises only when the
replicas really receive the actor's weights every step."""

import pytest
import ray
import torch
from trainer_test_helpers import mean_reward, run_experiment

from weightsync_core import BackendState, CheckpointEngineRegistry

STEPS = 10
WINDOW = 3
TOPOLOGY = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.num_replicas=2"]
ENGINE = "actor_rollout_ref.rollout.checkpoint_engine"


def _run(backend, steps, *extra):
    return run_experiment([*TOPOLOGY, f"{ENGINE}.backend={backend}",
                           f"trainer.total_training_steps={steps}", *extra])


@pytest.fixture(scope="module")
def gloo_run():
    """gloo with delta sync on: after the first full sync, patches (bit-exact or refused)."""
    runner, rows = _run("gloo", STEPS, f"{ENGINE}.delta=true")
    checksums = runner.trainer.weights_checksums()
    checksums["statuses"] = ray.get([
        worker.weights_status.remote()
        for replica in runner.trainer.server_manager.replicas for worker in replica.workers])
    runner.trainer.shutdown()
    return rows, checksums


@pytest.fixture(scope="module")
def noop_run():
    runner, rows = _run(
        "gloo", STEPS,
        "actor_rollout_ref.rollout.checkpoint_manager_class="
        "trainer_test_plugins.managers.NoOpCheckpointEngineManager",
    )
    checksums = runner.trainer.weights_checksums()
    runner.trainer.shutdown()
    return rows, checksums


def test_gloo_reward_rises(gloo_run):
    rows, _ = gloo_run
    first, last = mean_reward(rows[:WINDOW]), mean_reward(rows[-WINDOW:])
    assert first < 0.35, f"a random policy should score near 1/16, got {first:.3f}"
    assert last > first + 0.3, f"reward did not rise: first {first:.3f}, last {last:.3f}"
    assert all(row["weightsync/bytes"] > 0 for row in rows)


def test_gloo_replicas_hold_exactly_the_actor_weights(gloo_run):
    rows, checksums = gloo_run
    assert len(checksums["rollout"]) == 2
    assert checksums["rollout"] == [checksums["actor"]] * 2
    # the start-up sync was full; every step's sync sent patches against the replicas' copy
    assert [row["weightsync/delta"] for row in rows] == [1.0] * len(rows)
    # every sync was staged: the replicas generated on their version while the patches were
    # applied to a private copy (one copy of the model per worker, never the served
    # parameters), then swapped the staged tensors in; the ones they served are kept until
    # the next stage, to roll back to
    assert all(row["weightsync/staged"] == 1.0 for row in rows)
    model_bytes = rows[-1]["weightsync/model_bytes"]
    for status in checksums["statuses"]:
        assert status["delta_kept_bytes"] == model_bytes, status
        assert status["staged_bytes"] == 0 and status["rollback_version"] is None, status
    # each of the 2 actor ranks keeps its half of the last version, none the whole model
    for row in rows:
        assert 0 < row["weightsync/actor_kept_bytes"] <= row["weightsync/model_bytes"] / 2 + 64


def test_manager_that_moves_nothing_does_not_improve(noop_run, gloo_run):
    rows, checksums = noop_run
    first, last = mean_reward(rows[:WINDOW]), mean_reward(rows[-WINDOW:])
    assert last < first + 0.1, f"reward rose without weight sync: {first:.3f} -> {last:.3f}"
    assert last < mean_reward(gloo_run[0][-WINDOW:]) - 0.3
    # the actor trained, but the replicas still serve the initial weights
    assert all(rollout != checksums["actor"] for rollout in checksums["rollout"])


def _landed_backends():
    params = []
    for name in ("nixl", "mooncake", "kimi"):
        info = CheckpointEngineRegistry.available(probe=True)[name]
        landed = info.state in (BackendState.LOADED, BackendState.INSTALLED)
        reason = f"backend {name!r} has not landed here: {info.state}: {info.reason}"
        params.append(pytest.param(name, marks=pytest.mark.skipif(not landed, reason=reason)))
    return params


@pytest.mark.parametrize("backend", _landed_backends())
def test_same_run_with_every_landed_backend(backend):
    """Delta sync on: patches, bit-exact, with each actor rank keeping at most its half of
    the last version (kimi's ranks: their own shares; the ring engines' ranks: a slice each
    of every tensor)."""
    runner, rows = _run(backend, 3, f"{ENGINE}.delta=true")
    try:
        checksums = runner.trainer.weights_checksums()
    finally:
        runner.trainer.shutdown()
    assert checksums["rollout"] == [checksums["actor"]] * 2
    assert all(row["weightsync/bytes"] > 0 for row in rows)
    assert [row["weightsync/delta"] for row in rows] == [1.0] * len(rows)
    assert rows[-1]["reward/mean"] > rows[0]["reward/mean"]
    for row in rows:
        assert row["weightsync/actor_kept_bytes"] < row["weightsync/model_bytes"] * 0.75


def test_sharded_delivery_from_both_fsdp_ranks():
    """gloo_sharded: each of the 2 FSDP ranks sends its own rows (no gather) once; the two
    replicas, which need every tensor whole, relay them to each other."""
    runner, rows = _run("gloo_sharded", 3)
    try:
        checksums = runner.trainer.weights_checksums()
    finally:
        runner.trainer.shutdown()
    assert checksums["rollout"] == [checksums["actor"]] * 2
    # the most a worker received is the whole model; one copy left the ranks
    assert all(row["weightsync/bytes_sent"] == row["weightsync/bytes"] > 0 for row in rows)
    assert rows[-1]["reward/mean"] > rows[0]["reward/mean"]


def _tensor_parallel_run(steps, *extra):
    """A run into 2 replicas of 2 tensor-parallel workers over gloo_sharded: its rows, and the
    actor's tensors' shapes as they travel; checks every worker serves the actor's weights,
    the busiest received about half of them and the actor ranks sent each slice once."""
    runner, rows = _run("gloo_sharded", steps,
                        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", *extra)
    try:
        checksums = runner.trainer.weights_checksums()
        shapes = ray.get(runner.trainer.actor_wg.call_all("weight_shapes"))[0]
    finally:
        runner.trainer.shutdown()
    assert checksums["rollout"] == [checksums["actor"]] * 4
    model = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in shapes.values())
    for row in rows:
        assert 0.4 * model < row["weightsync/bytes"] < 0.6 * model, (row, model)
        assert row["weightsync/bytes_sent"] == model
    return rows, shapes


def test_moe_tensor_parallel_replicas_receive_only_their_experts_slices():
    """A mixture of experts (qwen3_moe, 4 experts of width 16: transformers 5 holds them
    fused) from 2 FSDP ranks, each streaming its whole experts one at a time, into 2
    replicas of 2 workers over gloo_sharded: each worker receives every expert's half and
    its share of the rest; every worker serves the actor's weights."""
    _, shapes = _tensor_parallel_run(2, "actor_rollout_ref.model.model_type=qwen3_moe",
                                     "actor_rollout_ref.model.num_experts=4",
                                     "actor_rollout_ref.model.moe_intermediate_size=16")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in shapes  # per expert


def test_tensor_parallel_replicas_receive_only_their_slices():
    """actor_rollout_ref.rollout.tensor_model_parallel_size=2 over gloo_sharded: 2 replicas
    of 2 workers, each receiving only its slices (the two replicas' workers relaying them to
    each other); each worker serves the actor's weights once its replica's slices are
    assembled (the busiest, rank 0, holds the whole 16-row vocabulary, padded to 64 and split
    32/32), and the reward rises."""
    rows, _ = _tensor_parallel_run(3)
    assert rows[-1]["reward/mean"] > rows[0]["reward/mean"]
