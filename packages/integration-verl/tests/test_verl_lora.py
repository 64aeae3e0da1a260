"""verl #7495 on weightsync: a LoRA policy (verl's FSDP2 actor with ``lora_rank=4``, 2 ranks)
synced into disaggregated rollout workers (verl's ``CheckpointEngineWorker``, 2 replicas).
verl 0.9.1 alone sends the frozen base every step and never the adapter; through a
weightsync backend the base arrives once and then only the adapter, with its
``peft_config`` and ``base_sync_done=True`` as verl's server adapters take it, in both ways
in (verl's manager and weightsync's). Without :func:`weightsync_verl.install_lora_delivery`
the first test fails (the replicas get the base under every step's load, no peft_config)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
import ray
import torch
from verl.checkpoint_engine import CheckpointEngineManager as VerlManager
from verl.single_controller.ray import RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import split_resource_pool
from verl.workers.config import CheckpointEngineConfig

from weightsync_core import AdapterMismatchError, SyncStageError
from weightsync_core.spi import WeightSyncError
from weightsync_verl import CheckpointEngineManager
from weightsync_verl.actor_group import make_actor_group, verl_trainer_config
from weightsync_verl.fully_async import replicas_stage
from weightsync_verl.lora import LoraHeader, deliver_sections
from weightsync_verl.scenario import RecordingReplica, make_rollout

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.target_modules=all-linear"]
CONFIG = CheckpointEngineConfig(
    backend="weightsync_gloo", update_weights_bucket_megabytes=1,
    engine_kwargs={"weightsync_gloo": {"timeout": 30}}, custom_backend_module="weightsync_verl",
)


@dataclass
class LoraDeployment:
    actor_wg: RayWorkerGroup
    rollout: RayWorkerGroup
    replicas: list[RecordingReplica]

    def call(self, group: RayWorkerGroup, method: str, *args: Any) -> Any:
        return getattr(group, method)(*args)

    def train_adapter(self, step: int) -> dict[str, Any]:
        """A step that moves only the adapter; returns what the actor exports of it."""
        self.call(self.actor_wg, "perturb", step, True)
        return self.call(self.actor_wg, "adapter_weights")[0]

    def loads(self) -> list[list[dict[str, Any]]]:
        return [report["loads"] for report in self.call(self.rollout, "report")]


@pytest.fixture(scope="module")
def deployment(ray_cluster, model_path):
    pool = RayResourcePool(process_on_nodes=[4], use_gpu=False, max_colocate_count=1)
    actor_pool, rollout_pool = split_resource_pool(pool, [2, 2])
    config = verl_trainer_config(model_path, {"backend": "naive"}, world_size=2, overrides=LORA)
    actor_wg = make_actor_group(config, actor_pool)
    actor_wg.use_backend(CONFIG)  # pyright: ignore[reportAttributeAccessIssue]
    rollout, replicas = make_rollout(CONFIG, model_path, rollout_pool, replica_size=1)
    yield LoraDeployment(actor_wg, rollout, replicas)
    for worker in [*actor_wg.workers, *rollout.workers]:
        ray.kill(worker)
    for group in pool.pgs or []:
        ray.util.remove_placement_group(group)


def _assert_adapter_arrived(load: dict[str, Any], adapter: dict[str, Any]) -> None:
    assert load["base_sync_done"] is True
    assert load["tensors"] == adapter["digests"]
    assert all(".lora_A." in name or ".lora_B." in name for name in load["tensors"])
    assert load["peft_config"]["r"] == 4 and load["peft_config"]["lora_alpha"] == 8
    assert sorted(load["peft_config"]["target_modules"]) == sorted(
        adapter["peft_config"]["target_modules"])


def test_verls_manager_delivers_the_base_once_then_only_the_adapter(deployment) -> None:
    base = deployment.call(deployment.actor_wg, "weights")[0]
    manager = VerlManager(config=CONFIG, actor_wg=deployment.actor_wg,
                          replicas=list(deployment.replicas))
    adapter = deployment.train_adapter(1)
    manager.update_weights(global_steps=1)
    for loads in deployment.loads():  # the first sync: base (dummy weights), then adapter
        base_load, adapter_load = loads[-2:]
        assert base_load["base_sync_done"] is False and base_load["peft_config"]["r"] == 4
        assert base_load["tensors"] == base["digests"]
        assert not any(".lora_" in name for name in base_load["tensors"])
        _assert_adapter_arrived(adapter_load, adapter)
    for step in (2, 3):  # the adapter changes; only it travels
        adapter = deployment.train_adapter(step)
        manager.update_weights(global_steps=step)
        for loads in deployment.loads():
            assert loads[-2]["base_sync_done"] is True  # the step before's adapter: no base
            _assert_adapter_arrived(loads[-1], adapter)


def test_weightsyncs_manager_moves_only_the_adapter(deployment) -> None:
    manager = CheckpointEngineManager(config=CONFIG, actor_wg=deployment.actor_wg,
                                      replicas=list(deployment.replicas))
    adapter = deployment.train_adapter(4)
    metrics = manager.update_weights(4)
    for loads in deployment.loads():
        _assert_adapter_arrived(loads[-1], adapter)
    header = metrics["weightsync/bytes"] - adapter["nbytes"]
    assert 0 < header < 4096  # the adapter and its header, no base
    assert metrics["weightsync/tensors"] == len(adapter["digests"]) + 1


async def _items(*items: tuple[str, torch.Tensor]):
    for item in items:
        yield item


def _header(phase: str = "adapter") -> tuple[str, torch.Tensor]:
    config = {"r": 2, "lora_alpha": 4, "target_modules": {"q_proj"}, "use_rslora": False}
    header = LoraHeader.of_config(phase, config)  # pyright: ignore[reportArgumentType]
    return header.name, header.to_tensor()


def _lora(side: str, shape: tuple[int, int]) -> tuple[str, torch.Tensor]:
    return f"base_model.model.layers.0.self_attn.q_proj.lora_{side}.weight", torch.ones(shape)


def _deliver(*items: tuple[str, torch.Tensor]) -> list[tuple[dict[str, Any], list[str]]]:
    calls = []

    async def update(weights, **kwargs):
        calls.append((kwargs, [name async for name, _ in weights]))

    asyncio.run(deliver_sections(_items(*items), update, global_steps=7))
    return calls


def test_a_plain_stream_is_one_load_and_sections_are_one_each() -> None:
    assert _deliver(("w", torch.ones(2))) == [({"global_steps": 7}, ["w"])]
    calls = _deliver(_header("base"), ("w", torch.ones(2)),
                           _header(), _lora("A", (2, 8)), _lora("B", (8, 2)))
    assert [(kwargs["base_sync_done"], names) for kwargs, names in calls] == [
        (False, ["w"]), (True, [_lora("A", (2, 8))[0], _lora("B", (8, 2))[0]])]
    assert calls[1][0]["peft_config"]["target_modules"] == ["q_proj"]


@pytest.mark.parametrize(("items", "words"), [
    ((_header(), _lora("A", (3, 8)), _lora("B", (8, 3))), "rank 2"),
    ((_header(), _lora("A", (2, 8))), "lora_A only"),
    ((_header(), ("model.norm.weight", torch.ones(2))), "not a LoRA weight"),
    ((_header("base"), _lora("A", (2, 8))), "among the base weights"),
])
def test_a_section_that_does_not_fit_its_header_is_refused(items, words) -> None:
    with pytest.raises((AdapterMismatchError, WeightSyncError), match=words):
        _deliver(*items)


@pytest.mark.parametrize(("tensor", "words"), [
    (torch.ones(4), "uint8"),
    (torch.frombuffer(bytearray(b"\x80abc"), dtype=torch.uint8), "not a LoRA header"),
    (torch.frombuffer(bytearray(b'{"phase": "x", "peft_config": {}}'), dtype=torch.uint8),
     "not a LoRA header"),
    (torch.zeros((1 << 20) + 1, dtype=torch.uint8), "over the"),
    (_header("base")[1], "a base header named"),
])
def test_a_malformed_header_is_refused(tensor, words) -> None:
    with pytest.raises(WeightSyncError, match=words):
        LoraHeader.from_tensor("weightsync_verl.lora_header.adapter", tensor)


def test_delta_sync_moves_the_adapters_patches(deployment) -> None:
    config = CheckpointEngineConfig(
        backend="weightsync_gloo", update_weights_bucket_megabytes=1,
        engine_kwargs={"weightsync_gloo": {"timeout": 30, "delta": True}},
        custom_backend_module="weightsync_verl")
    for group in (deployment.actor_wg, deployment.rollout):
        group.use_backend(config)  # pyright: ignore[reportAttributeAccessIssue]
    manager = VerlManager(config=config, actor_wg=deployment.actor_wg,
                          replicas=list(deployment.replicas))
    for step in (5, 6, 7):
        adapter = deployment.train_adapter(step)
        metrics = manager.update_weights(global_steps=step)
        for loads in deployment.loads():
            _assert_adapter_arrived(loads[-1], adapter)  # rebuilt bit-exact from patches
        assert metrics["weightsync/delta"] == (0.0 if step == 5 else 1.0)


def test_staging_workers_refuse_a_lora_sync_naming_why(deployment, model_path) -> None:
    pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
    rollout, replicas = make_rollout(CONFIG, model_path, pool, replica_size=1, staging=True)
    try:
        for group in (deployment.actor_wg, rollout):
            group.use_backend(CONFIG)  # pyright: ignore[reportAttributeAccessIssue]
        manager = CheckpointEngineManager(config=CONFIG, actor_wg=deployment.actor_wg,
                                          replicas=replicas)
        deployment.train_adapter(8)
        with pytest.raises(SyncStageError, match=r"staging workers .* do not take LoRA syncs"):
            manager.update_weights(8)
    finally:
        for worker in rollout.workers:
            ray.kill(worker)
        for group in pool.pgs or []:
            ray.util.remove_placement_group(group)


@pytest.mark.parametrize(("overrides", "stage"), [
    ((), True),
    (LORA, False),
    ((*LORA, "actor_rollout_ref.model.lora.merge=true"), True),  # merged: plain weights
])
def test_the_fully_async_rollouter_stages_unless_the_policy_is_lora(
        model_path, overrides, stage) -> None:
    config = verl_trainer_config(model_path, {"backend": "weightsync_gloo"}, world_size=1,
                                 overrides=overrides)
    assert replicas_stage(config) is stage
