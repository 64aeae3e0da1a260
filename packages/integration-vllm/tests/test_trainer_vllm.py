"""``weightsync-train rollout.name=vllm``: GRPO with 2 actor ranks and 2 vLLM replicas; the
reward rises only if every step's weights reach vLLM."""

import ray

from weightsync_trainer import TaskRunner, load_config

STEPS = 12
WINDOW = 3
# vLLM's CPU attention needs a head size of 32 or more: 2 heads of 32
MODEL = ["model.hidden_size=64", "model.intermediate_size=128"]


def _mean_reward(rows):
    return sum(row["reward/mean"] for row in rows) / len(rows)


def _run(steps: int, *overrides: str) -> tuple[list[dict], list[dict]]:
    """A GRPO run of ``steps`` steps into 2 vLLM replicas: its rows, and what each replica's
    worker serves at the end."""
    runner = TaskRunner(load_config(overrides=[
        "rollout.name=vllm", "rollout.num_replicas=2", "actor.world_size=2",
        f"trainer.total_steps={steps}", *MODEL, *overrides,
    ]))
    try:
        rows = runner.run()
        statuses = ray.get([worker.weights_status.remote()
                            for replica in runner.trainer.server_manager.replicas
                            for worker in replica.workers])
    finally:
        runner.trainer.shutdown()
    return rows, statuses


def test_grpo_with_vllm_replicas_raises_the_reward():
    rows, statuses = _run(STEPS)
    first, last = _mean_reward(rows[:WINDOW]), _mean_reward(rows[-WINDOW:])
    assert first < 0.35, f"a random policy should score near 1/16, got {first:.3f}"
    assert last > first + 0.3, f"reward did not rise: first {first:.3f}, last {last:.3f}"
    assert all(row["weightsync/bytes"] > 0 for row in rows)
    assert statuses == [{"version": rows[-1]["step"], "complete": True, "adapters": {}}] * 2


def test_lora_grpo_with_vllm_replicas_syncs_only_the_adapter_into_vllm():
    """A LoRA actor: the base synced once, then each step's adapter, which vLLM serves (in
    memory) to the next step's requests; every replica keeps the last two versions."""
    steps = 3
    rows, statuses = _run(steps, "actor_rollout_ref.model.lora_rank=4",
                          "actor_rollout_ref.actor.optim.lr=0.05")
    hidden, rank, layers = 64, 4, 2  # q_proj and v_proj: [rank, 64] and [64, rank] each
    adapter_bytes = layers * 2 * (rank * hidden + hidden * rank) * 4
    assert [row["weightsync/bytes"] for row in rows] == [adapter_bytes] * steps
    assert statuses == [{"version": 0, "complete": True,
                         "adapters": {"policy": [steps - 1, steps]}}] * 2
