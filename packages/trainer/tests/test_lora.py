"""LoRA: the trainer's Hugging Face replicas serve adapter versions through PEFT, and a LoRA
run syncs the base once, then only the adapter, every replica serving the actor's adapter."""

import asyncio

import pytest
import ray
import torch
from trainer_test_helpers import run_experiment

from weightsync_core import WeightSyncError
from weightsync_trainer import load_config
from weightsync_trainer.config import ModelConfig
from weightsync_trainer.errors import ConfigError
from weightsync_trainer.lora import (
    adapter_parameters,
    adapter_spec,
    base_parameters,
    with_adapter,
)
from weightsync_trainer.modeling import build_policy_model
from weightsync_trainer.workers.generation import HFGenerationServer

MODEL = ModelConfig(lora_rank=4, lora_alpha=8)
PROMPT = torch.tensor([[1, 2, 3, 4]])


def _trained_adapter(seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A PEFT policy whose adapter is not zero (as after training), and its tensors."""
    policy = with_adapter(build_policy_model(MODEL), MODEL).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return policy, {name: tensor.detach().clone()
                    for name, tensor in adapter_parameters(policy.named_parameters())}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits[0, -1]


def test_replica_serves_two_versions_side_by_side_as_peft_does():
    server = HFGenerationServer(MODEL, temperature=1.0)
    spec = adapter_spec(MODEL)
    policies = {version: _trained_adapter(version) for version in (1, 2)}

    async def serve() -> None:
        for version, (_, tensors) in policies.items():
            await server.load_adapter(spec, version, tensors)
        assert server.adapters.held() == {"policy": [1, 2]}
        for version, (policy, _) in policies.items():
            server.adapters.activate(("policy", version))
            assert torch.equal(_logits(server.model), _logits(policy))
        server.adapters.activate(None)
        with policies[1][0].disable_adapter():
            assert torch.equal(_logits(server.model), _logits(policies[1][0]))
        # the base weights keep their checkpoint names: weight syncs still fit
        assert sorted(server.checkpoint_tensors()) == sorted(
            name for name, _ in base_parameters(policies[1][0].named_parameters()))
        await server.drop_adapter("policy", 1)
        with pytest.raises(WeightSyncError, match=r"no version 1 of adapter 'policy' \(it "
                                                  r"holds \[2\]\)"):
            await server.generate(PROMPT, 4, seed=0, adapter=("policy", 1))
        # a version that does not fit is refused whole; version 2 serves as it did
        broken = dict(policies[1][1])
        broken.pop(next(iter(broken)))
        with pytest.raises(ValueError, match="does not fit"):
            await server.load_adapter(spec, 3, broken)
        assert server.adapters.held() == {"policy": [2]}
        server.adapters.activate(("policy", 2))
        assert torch.equal(_logits(server.model), _logits(policies[2][0]))
        # version 3 is copied into the adapter version 1 left (no new PEFT layers)
        layers = sum(1 for _ in server.model.modules())
        await server.load_adapter(spec, 3, policies[1][1])
        assert sum(1 for _ in server.model.modules()) == layers
        for version, policy in ((3, policies[1][0]), (2, policies[2][0])):
            server.adapters.activate(("policy", version))
            assert torch.equal(_logits(server.model), _logits(policy))

    asyncio.run(serve())


def test_lora_configs_that_cannot_run_are_refused():
    with pytest.raises(ConfigError, match="target_modules must be a non-empty list"):
        load_config(overrides=["actor_rollout_ref.model.lora_rank=4",
                               "actor_rollout_ref.model.target_modules=[]"])


def test_a_colocated_lora_run_syncs_the_adapter_into_each_ranks_server():
    """backend naive: each actor rank's in-process server holds the adapter versions."""
    runner, rows = run_experiment([
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        "trainer.total_training_steps=3", "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj,lm_head]",
        "actor_rollout_ref.actor.optim.lr=0.05"])
    trainer = runner.trainer
    try:
        actor = ray.get(trainer.actor_wg.call_all("adapter_checksum"))[0]
        served = ray.get(trainer.actor_wg.call_all("served_adapter_checksum", "policy", 3))
        status = trainer.checkpoint_manager.adapter_status()
    finally:
        trainer.shutdown()
    assert served == [actor, actor]
    assert status == {"replica 0": {"policy": [2, 3]}, "replica 1": {"policy": [2, 3]}}
    assert len(rows) == 3 and all(row["weightsync/tensors"] > 0 for row in rows)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    runner, rows = run_experiment([
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.num_replicas=2",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo_sharded",
        "trainer.async_rollout.enable=true",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "trainer.total_training_steps=4", "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj,lm_head]",
        "actor_rollout_ref.actor.optim.lr=0.05"])
    trainer = runner.trainer
    workers = [worker for replica in trainer.server_manager.replicas
               for worker in replica.workers]
    report = {
        "rows": rows, "checksums": trainer.weights_checksums(),
        "actor_adapter": ray.get(trainer.actor_wg.call_all("adapter_checksum"))[0],
        "served": ray.get([worker.adapter_checksum.remote("policy", 4) for worker in workers]),
        "status": trainer.checkpoint_manager.adapter_status(),
        "versions": ray.get([worker.weights_status.remote() for worker in workers]),
        "saved": trainer.save_weights(str(tmp_path_factory.mktemp("lora-weights"))),
    }
    trainer.shutdown()
    return report


def test_an_async_lora_run_over_a_sharded_backend_syncs_only_the_adapter(lora_run):
    rows = lora_run["rows"]
    model = ModelConfig()
    params = sum(tensor.numel() for _, tensor in build_policy_model(model).named_parameters())
    adapter = 4 * 2 * (2 * (model.hidden_size + model.hidden_size)) + 4 * (
        model.hidden_size + model.vocab_size)
    assert [row["weightsync/bytes"] for row in rows] == [adapter * 4] * len(rows)
    assert adapter < 0.2 * params
    assert lora_run["actor_adapter"] and lora_run["served"] == [lora_run["actor_adapter"]] * 4
    # the base synced once, unchanged since: the replicas serve the actor's base
    assert lora_run["checksums"]["rollout"] == [lora_run["checksums"]["actor"]] * 4
    assert all(status["version"] == 0 for status in lora_run["versions"])
    assert lora_run["status"] == {"replica 0": {"policy": [3, 4]},
                                  "replica 1": {"policy": [3, 4]}}
    assert rows[-1]["reward/mean"] > rows[0]["reward/mean"]
    # rollout ran ahead (asynchronous RL): no batch older than max_staleness (1) adapter
    # versions, each token's version the adapter version its request named
    assert all(0 <= row["async/staleness_max"] <= 1 for row in rows)
    assert rows[0]["async/staleness_max"] == 0  # the first batch: version 0, trained from 0


def test_a_lora_policy_saves_its_base_and_its_adapter_as_peft_loads_them(lora_run):
    from pathlib import Path

    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from weightsync_trainer.checksum import weights_digest

    directory = str(Path(lora_run["saved"]).parent)
    base = AutoModelForCausalLM.from_pretrained(directory)
    assert weights_digest(base.named_parameters()) == lora_run["checksums"]["actor"]
    policy = PeftModel.from_pretrained(base, f"{directory}/adapter")
    saved = {f"base_model.model.{name.removeprefix('base_model.model.')}": tensor
             for name, tensor in get_peft_model_state_dict(policy).items()
             if name.endswith((".lora_A.weight", ".lora_B.weight"))}
    assert weights_digest(saved.items()) == lora_run["actor_adapter"]
