"""Every extension point on one live PPO run (actor, critic, a two-worker replica):
checkpoint_manager_class, custom_backend_module, extra_context per role, LLMServerManager and
LLMServerClient subclasses."""

import asyncio
import math
import os

import pytest
import ray
import torch
from trainer_test_plugins.managers import RecordingCheckpointEngineManager
from trainer_test_plugins.serving import RecordingLoadBalancer, RoundRobinClient, TaggedReplica

from weightsync_core import PluginError, run_sync
from weightsync_trainer import (
    LLMServerClient,
    LLMServerManager,
    NoLoadBalancerError,
    RayPPOTrainer,
    TaskRunner,
    load_config,
)

STEPS = 3
ACTOR_CONTEXT = {"run": {"tags": ["a", "b"], "depth": {"level": 2}}, "scale": torch.arange(4.0)}
CRITIC_CONTEXT = {"baseline": torch.tensor([[1.5, -2.0]]), "nested": {"k": [1, {"x": None}]}}
OVERRIDES = [
    "algorithm.adv_estimator=gae",
    "trainer.n_gpus_per_node=1",
    "critic.world_size=1",
    "actor_rollout_ref.rollout.num_replicas=1",
    "actor_rollout_ref.rollout.workers_per_replica=2",
    "actor_rollout_ref.rollout.name=not-a-registered-server",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=trainer_test_gloo",
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module="
    "trainer_test_plugins.backend",
    "actor_rollout_ref.rollout.checkpoint_manager_class="
    "trainer_test_plugins.managers.RecordingCheckpointEngineManager",
    f"trainer.total_training_steps={STEPS}",
]


class TaggedServerManager(LLMServerManager):
    """Sets rollout_replica_class before __init__: rollout.name is never looked up."""

    load_balancer_cls = RecordingLoadBalancer

    def __init__(self, *args, **kwargs):
        self.rollout_replica_class = TaggedReplica
        super().__init__(*args, **kwargs)


class HookedTrainer(RayPPOTrainer):
    server_manager_cls = TaggedServerManager


class ContextRunner(TaskRunner):
    trainer_cls = HookedTrainer

    def extra_context(self, role):
        return {"actor": ACTOR_CONTEXT, "critic": CRITIC_CONTEXT}[role]


def _values_equal(got, expected):
    if isinstance(expected, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, expected)
    if isinstance(expected, dict):
        return got.keys() == expected.keys() and all(
            _values_equal(got[k], v) for k, v in expected.items()
        )
    if isinstance(expected, list):
        return len(got) == len(expected) and all(
            _values_equal(g, e) for g, e in zip(got, expected, strict=True)
        )
    return got == expected


@pytest.fixture(scope="module")
def hooked():
    runner = ContextRunner(load_config(overrides=OVERRIDES))
    trainer = runner.build_trainer()
    runner.trainer = trainer
    try:
        run_sync(trainer.init_workers())
        critic_before = ray.get(trainer.critic_wg.call_all("weights_checksum"))[0]
        rows = trainer.run()
        yield trainer, rows, critic_before
    finally:
        trainer.shutdown()


def test_ppo_with_critic_trains(hooked):
    trainer, rows, critic_before = hooked
    assert len(rows) == STEPS
    for row in rows:
        for key in ("critic/value_loss", "critic/grad_norm", "actor/pg_loss", "actor/grad_norm"):
            assert math.isfinite(row[key]), (key, row)
    assert ray.get(trainer.critic_wg.call_all("weights_checksum"))[0] != critic_before
    checksums = trainer.weights_checksums()
    assert checksums["rollout"] == [checksums["actor"]] * 2


def test_checkpoint_manager_class_from_config_is_used(hooked):
    trainer, _, _ = hooked
    assert type(trainer.checkpoint_manager) is RecordingCheckpointEngineManager
    assert trainer.checkpoint_manager.synced_steps == [0, *range(1, STEPS + 1)]


def test_non_subclass_manager_is_refused_before_any_worker_starts():
    config = load_config(overrides=[
        "actor_rollout_ref.rollout.checkpoint_manager_class="
        "trainer_test_plugins.managers.NotAManager"
    ])
    with pytest.raises(PluginError, match=r"is not a subclass of .*CheckpointEngineManager"):
        RayPPOTrainer(config)


def test_path_like_manager_class_is_refused():
    config = load_config(overrides=[
        "actor_rollout_ref.rollout.checkpoint_manager_class=./managers.py:Manager"])
    with pytest.raises(PluginError, match="file path"):
        RayPPOTrainer(config)


def test_custom_backend_module_registers_in_actor_critic_and_rollout(hooked):
    trainer, _, _ = hooked
    engine = "trainer_test_plugins.backend.TrainerTestGlooEngine"
    assert trainer.checkpoint_manager.backend_cls.__module__ == "trainer_test_plugins.backend"
    [actor] = ray.get(trainer.actor_wg.call_all("worker_info"))
    [critic] = ray.get(trainer.critic_wg.call_all("worker_info"))
    rollout = ray.get([w.worker_info.remote() for w in trainer.server_manager.replicas[0].workers])
    assert actor["engine_class"] == engine
    assert [info["engine_class"] for info in rollout] == [engine, engine]
    assert critic["custom_backend_modules_imported"] == ["trainer_test_plugins.backend"]
    pids = {actor["pid"], critic["pid"], *(info["pid"] for info in rollout)}
    assert len(pids) == 4 and os.getpid() not in pids


def test_extra_context_reaches_actor_and_critic_processes(hooked):
    trainer, _, _ = hooked
    [actor] = ray.get(trainer.actor_wg.call_all("get_extra_context"))
    [critic] = ray.get(trainer.critic_wg.call_all("get_extra_context"))
    assert _values_equal(actor, ACTOR_CONTEXT)
    assert _values_equal(critic, CRITIC_CONTEXT)


def test_critic_context_comes_from_trainer_attribute():
    trainer = RayPPOTrainer(load_config(overrides=["algorithm.adv_estimator=gae"]))
    assert trainer.worker_config("critic").extra_context == {}
    trainer._critic_extra_context = {"from": "trainer"}
    assert trainer.worker_config("critic").extra_context == {"from": "trainer"}
    assert trainer.worker_config("actor").extra_context == {}


def test_manager_subclass_skips_registry_and_uses_its_balancer(hooked):
    trainer, _, _ = hooked
    manager = trainer.server_manager
    assert [type(replica) for replica in manager.replicas] == [TaggedReplica]
    seen = ray.get(manager.load_balancer.seen.remote())
    assert f"step{STEPS}-prompt0" in seen


def test_unknown_rollout_name_without_subclass_is_a_clear_error():
    config = load_config(overrides=["actor_rollout_ref.rollout.name=vllmm"])
    with pytest.raises(ValueError, match=r"rollout\.name=.vllmm. is not a known rollout server"):
        LLMServerManager(config)


def test_vllm_rollout_without_weightsync_vllm_names_the_package_to_install():
    # the trainer's own environment has no weightsync-vllm
    config = load_config(overrides=["actor_rollout_ref.rollout.name=vllm"])
    with pytest.raises(ValueError, match=r"rollout\.name='vllm' needs .*weightsync-vllm\[cpu"):
        LLMServerManager(config)


def test_client_subclass_routes_itself_without_a_balancer(hooked):
    trainer, _, _ = hooked
    replicas = trainer.server_manager.replicas
    client = RoundRobinClient(trainer.config, servers=replicas)
    prompts = torch.zeros(4, trainer.config.data.max_prompt_length, dtype=torch.long)
    out = run_sync(client.generate(prompts, request_id="self-routed", seed=1))
    assert out.shape == (4, trainer.config.data.max_response_length)
    assert client.routed == [replicas[0].name]
    made = trainer.server_manager.get_client(client_cls=RoundRobinClient)
    assert type(made) is RoundRobinClient


def test_base_client_without_balancer_fails_clearly_on_first_request():
    config = load_config()
    client = LLMServerClient(config)  # constructing it is fine
    prompts = torch.zeros(2, config.data.max_prompt_length, dtype=torch.long)
    with pytest.raises(NoLoadBalancerError, match="override _acquire_server"):
        asyncio.run(client.generate(prompts, request_id="r1", seed=0))


def test_client_rejects_unknown_keyword_arguments():
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        LLMServerClient(load_config(), None, bogus=1)
