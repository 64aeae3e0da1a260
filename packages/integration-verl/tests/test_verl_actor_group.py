"""weightsync's manager (way 2) and verl's (way 1) with verl's real actor worker group:
verl's ``ActorRolloutRefWorker`` with FSDP2 on CPU, 2 ranks in a colocated group built as
``RayPPOTrainer.init_workers`` builds it (its actors expose ``actor_rollout_*`` methods),
and verl's ``CheckpointEngineWorker``s as 2 replicas of one worker. The CPU stand-ins
(platform, gloo default group, the naive hand-over's rollout) are named in
:mod:`weightsync_verl.actor_group`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import ray
from verl.checkpoint_engine import CheckpointEngineManager as VerlManager
from verl.single_controller.ray import RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import split_resource_pool
from verl.utils.import_utils import load_class_from_fqn
from verl.workers.config import CheckpointEngineConfig

from weightsync_core import SyncStageError
from weightsync_verl import CheckpointEngineManager, role_prefix
from weightsync_verl.actor_group import make_actor_group, verl_trainer_config
from weightsync_verl.scenario import RecordingReplica, make_rollout

WEIGHTSYNC_MANAGER = "weightsync_verl.CheckpointEngineManager"


def _config(backend: str) -> CheckpointEngineConfig:
    if backend == "naive":  # verl's own, which takes no options
        return CheckpointEngineConfig(backend="naive", update_weights_bucket_megabytes=1)
    name = f"weightsync_{backend}"
    return CheckpointEngineConfig(
        backend=name, update_weights_bucket_megabytes=1,
        engine_kwargs={name: {"timeout": 30}}, custom_backend_module="weightsync_verl",
    )


@dataclass
class Deployment:
    """verl's actor group, the rollout workers and their replicas."""

    actor_wg: RayWorkerGroup
    rollout: RayWorkerGroup
    replicas: list[RecordingReplica]
    pool: RayResourcePool

    def use_backend(self, config: CheckpointEngineConfig) -> None:
        self.actor_wg.use_backend(config)  # pyright: ignore[reportAttributeAccessIssue]
        if config.backend != "naive":  # the naive hand-over has no rollout workers
            self.rollout.use_backend(config)  # pyright: ignore[reportAttributeAccessIssue]

    def perturb(self, step: int) -> dict[str, Any]:
        """New weights on the actor ranks; returns their digests and bytes."""
        self.actor_wg.perturb(step)  # pyright: ignore[reportAttributeAccessIssue]
        return self.actor_wg.weights()[0]  # pyright: ignore[reportAttributeAccessIssue]

    def check(self, expected: dict[str, str], step: int) -> None:
        reports = self.rollout.report()  # pyright: ignore[reportAttributeAccessIssue]
        for worker, report in enumerate(reports):
            assert report["received"] == expected, f"rollout worker {worker} got other weights"
            assert report["global_steps"][-1] == step

    def weightsync_manager(self, backend: str, replicas: bool = True) -> CheckpointEngineManager:
        """weightsync's manager, loaded as verl's trainer loads checkpoint_manager_class."""
        config = _config(backend)
        self.use_backend(config)
        manager_cls = load_class_from_fqn(WEIGHTSYNC_MANAGER, "CheckpointEngineManager")
        return manager_cls(config=config, actor_wg=self.actor_wg,
                           replicas=list(self.replicas) if replicas else [])


@pytest.fixture(scope="module")
def deployment(ray_cluster, model_path):
    pool = RayResourcePool(process_on_nodes=[4], use_gpu=False, max_colocate_count=1)
    actor_pool, rollout_pool = split_resource_pool(pool, [2, 2])
    trainer_config = verl_trainer_config(model_path, {"backend": "naive"}, world_size=2)
    actor_wg = make_actor_group(trainer_config, actor_pool)
    rollout, replicas = make_rollout(_config("gloo"), model_path, rollout_pool, replica_size=1)
    yield Deployment(actor_wg, rollout, replicas, pool)
    for worker in [*actor_wg.workers, *rollout.workers]:
        ray.kill(worker)
    for group in pool.pgs or []:
        ray.util.remove_placement_group(group)


def test_the_actor_group_is_verls_colocated_one(deployment) -> None:
    assert role_prefix(deployment.actor_wg) == "actor_rollout_"
    with pytest.raises(AttributeError):  # what a caller of the raw method names meets
        deployment.actor_wg.workers[0].update_weights  # noqa: B018


@pytest.mark.parametrize("backend", ["gloo", "nixl"])
def test_weightsyncs_manager_syncs_verls_actor_group_three_times(deployment, backend) -> None:
    manager = deployment.weightsync_manager(backend)
    for step in (1, 2, 3):
        expected = deployment.perturb(step)
        metrics = manager.update_weights(step)
        deployment.check(expected["digests"], step)
        assert metrics["weightsync/bytes"] == expected["nbytes"]
        assert metrics["weightsync/tensors"] == len(expected["digests"])
    assert manager.stale_replicas == []


def test_weightsyncs_manager_runs_verls_naive_hand_over(deployment) -> None:
    manager = deployment.weightsync_manager("naive", replicas=False)
    for step in (4, 5, 6):
        expected = deployment.perturb(step)
        assert manager.update_weights(step) == {}
        reports = deployment.actor_wg.rollout_report()
        for rank, report in enumerate(reports):
            assert report["received"] == expected["digests"], f"actor rank {rank}'s rollout"
            assert report["global_steps"][-1] == step


def test_a_sender_failure_is_reported_with_its_cause_and_the_replicas_listed_stale(
    deployment,
) -> None:
    manager = deployment.weightsync_manager("gloo")
    deployment.perturb(7)
    deployment.actor_wg.fail_next_sync_after(3)
    with pytest.raises(SyncStageError) as info:
        manager.update_weights(7)
    error = info.value
    assert error.stage == "transfer"
    assert "injected sender failure after 3 tensors" in str(error)
    assert error.worker is not None and error.worker.startswith("actor_wg rank")
    assert manager.stale_replicas == deployment.replicas
    expected = deployment.perturb(8)
    manager.update_weights(8)
    deployment.check(expected["digests"], 8)
    assert manager.stale_replicas == []


def test_verls_manager_logs_the_bytes_of_the_model(deployment) -> None:
    config = _config("gloo")
    deployment.use_backend(config)
    manager = VerlManager(config=config, actor_wg=deployment.actor_wg,
                          replicas=list(deployment.replicas))
    expected = deployment.perturb(9)
    metrics = manager.update_weights(global_steps=9)  # as verl's trainer calls it
    deployment.check(expected["digests"], 9)
    # both actor ranks return metrics; the one that only iterated returns none
    assert metrics["weightsync/bytes"] == expected["nbytes"]
