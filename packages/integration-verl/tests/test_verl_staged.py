"""Staged syncs into verl's rollout workers (weightsync-verl's StagingCheckpointEngineWorker,
verl's CheckpointEngineWorker with weightsync's two phases), driven by weightsync's manager
through ``checkpoint_manager_class`` and from verl's fully-async trainer
(``weightsync_verl.fully_async``): a trainer rank, two replicas of two workers, gloo."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from omegaconf import OmegaConf
from verl.checkpoint_engine import CheckpointEngineManager as VerlCheckpointEngineManager
from verl.single_controller.ray import RayClassWithInitArgs
from verl.workers.config import CheckpointEngineConfig
from verl.workers.rollout import RolloutReplica
from verl.workers.rollout.replica import RolloutReplicaRegistry, get_rollout_replica_class

from weightsync_core import SyncStageError
from weightsync_verl import CheckpointEngineManager
from weightsync_verl.fully_async import FullyAsyncTrainer
from weightsync_verl.scenario import (
    RecordingCheckpointEngineWorker,
    RecordingReplica,
    VerlCluster,
    make_cluster,
    make_manager,
)
from weightsync_verl.staging import (
    StagingCheckpointEngineWorker,
    staging_replica_class,
    use_staging_replicas,
)

WEIGHTSYNC_MANAGER = "weightsync_verl.CheckpointEngineManager"


def _config() -> CheckpointEngineConfig:
    return CheckpointEngineConfig(
        backend="weightsync_gloo", update_weights_bucket_megabytes=1,
        engine_kwargs={"weightsync_gloo": {"timeout": 60}},
        custom_backend_module="weightsync_verl",
    )


@pytest.fixture(scope="module")
def cluster(ray_cluster, model_path):
    cluster = make_cluster(_config(), model_path, num_trainer=1, num_rollout=4,
                           replica_size=2, staging=True)
    yield cluster
    cluster.shutdown()


def _served(cluster: VerlCluster) -> list[dict[str, str]]:
    return [report["received"] for report in cluster.reports()]


def test_weightsyncs_manager_stages_while_verls_replicas_serve_then_switches(cluster) -> None:
    manager = make_manager(cluster, WEIGHTSYNC_MANAGER)
    assert manager.stages_syncs()
    first = cluster.perturb(1)
    metrics = manager.update_weights(1)  # both phases, as verl's trainers call it
    assert metrics["weightsync/staged"] == 1.0
    assert _served(cluster) == [first] * 4

    second = cluster.perturb(2)
    manager.stage_weights(2)
    assert _served(cluster) == [first] * 4, "a replica's server saw the stage before its commit"
    status = manager.weights_status()
    assert [replica["state"] for replica in status.values()] == ["staged", "staged"], status
    assert all(replica["version"] == 1 and replica["staged_version"] == 2
               for replica in status.values()), status
    manager.commit_weights()
    assert _served(cluster) == [second] * 4
    assert [report["global_steps"][-1] for report in cluster.reports()] == [2] * 4


def test_verls_fully_async_calls_run_staged_from_a_coroutine(cluster) -> None:
    # verl's FullyAsyncTrainer._fit_update_weights: await update_weights(global_steps=...)
    manager = make_manager(cluster, WEIGHTSYNC_MANAGER)

    async def fit_update_weights() -> dict[str, float]:
        return await manager.update_weights(global_steps=3)

    expected = cluster.perturb(3)
    metrics = asyncio.run(fit_update_weights())
    assert metrics["weightsync/staged"] == 1.0
    assert _served(cluster) == [expected] * 4


def test_a_load_failing_in_phase_2_rolls_its_replica_back(cluster) -> None:
    manager = make_manager(cluster, WEIGHTSYNC_MANAGER)
    before = cluster.perturb(4)
    manager.update_weights(4)  # a staged commit: every worker keeps a copy to roll back to
    ray.get(cluster.rollout.workers[0].refuse_updates.remote(1))
    after = cluster.perturb(5)
    with pytest.raises(SyncStageError) as raised:
        manager.update_weights(5)
    message = str(raised.value)
    assert raised.value.stage == "commit", message
    assert "rolled back" in message, message
    # replica 0: the worker whose server failed part-way and its peer, which had taken the
    # stage, are back on version 4; replica 1 switched to 5
    assert _served(cluster) == [before, before, after, after], message
    assert manager.stale_replicas == []
    latest = cluster.perturb(6)
    manager.update_weights(6)
    assert _served(cluster) == [latest] * 4


def test_verls_manager_drives_staging_workers_stop_the_world(cluster) -> None:
    expected = cluster.perturb(7)
    manager = make_manager(cluster)

    async def train() -> None:
        await manager.update_weights(global_steps=7)

    asyncio.run(train())
    assert _served(cluster) == [expected] * 4


class _ServedReplica(RecordingReplica):
    """A replica building its workers as verl's replicas do (verl's own method)."""

    get_ray_class_with_init_args = RolloutReplica.get_ray_class_with_init_args


class _OwnWorkersReplica(RecordingReplica):
    """A replica building workers of its own class."""

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        return RayClassWithInitArgs(cls=ray.remote(RecordingCheckpointEngineWorker))


def test_use_staging_replicas_gives_verls_replica_class_with_staging_workers() -> None:
    registry = RolloutReplicaRegistry._registry  # restored below
    saved = dict(registry)
    try:
        RolloutReplicaRegistry.register("served", lambda: _ServedReplica)
        RolloutReplicaRegistry.register("recording", lambda: RecordingReplica)
        use_staging_replicas("served", "recording")
        use_staging_replicas("served")  # once is enough: not wrapped twice
        replica_class = get_rollout_replica_class("served")
        assert replica_class.__mro__[1] is _ServedReplica
        replica = replica_class.__new__(replica_class)
        replica.config, replica.model_config, replica.replica_rank = "rollout", "model", 3
        built = replica.get_ray_class_with_init_args()
        assert built.cls.__ray_actor_class__ is StagingCheckpointEngineWorker
        assert built.kwargs == {"rollout_config": "rollout", "model_config": "model",
                                "replica_rank": 3}  # what verl's replica gives its workers
        other = get_rollout_replica_class("recording").__new__(
            get_rollout_replica_class("recording"))
        with pytest.raises(NotImplementedError):  # its own method, as it was
            other.get_ray_class_with_init_args()
        with pytest.raises(ValueError, match="no rollout replica named 'absent'"):
            use_staging_replicas("absent")
        own = staging_replica_class(_OwnWorkersReplica)
        with pytest.raises(TypeError, match="builds RecordingCheckpointEngineWorker workers"):
            own.__new__(own).get_ray_class_with_init_args()
    finally:
        registry.clear()
        registry.update(saved)


@ray.remote
class _Rollouter:
    """What verl's FullyAsyncTrainer asks of its rollouter around a sync (the replicas are
    the scenario's, built in the test process as verl's rollouter builds its own)."""

    def __init__(self, replicas: list[RecordingReplica]) -> None:
        self.replicas = replicas
        self.resets = 0

    def get_replicas(self) -> list[RecordingReplica]:
        return self.replicas

    def get_total_produced_samples(self) -> int:
        return 0

    def get_completed_steps(self) -> int:
        return 0

    def reset_staleness(self) -> dict[str, float]:
        self.resets += 1
        return {"fully_async/resets": float(self.resets)}


class _Logged:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []

    def log(self, data: dict[str, float], step: int) -> None:
        self.logged.append((data, step))


def _fully_async_trainer(cluster: VerlCluster, manager_class: str | None) -> Any:
    """weightsync-verl's FullyAsyncTrainer with what verl's own ``_setup_checkpoint_manager``
    and ``_fit_update_weights`` read (verl builds the rest from a whole training config)."""
    trainer = FullyAsyncTrainer.__new__(FullyAsyncTrainer)
    engine = OmegaConf.structured(cluster.config)
    engine._target_ = "verl.workers.config.CheckpointEngineConfig"  # as verl's YAML says
    rollout = {"checkpoint_engine": engine, "checkpoint_manager_class": manager_class,
               "name": "vllm"}
    trainer.config = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout},
                                       "global_profiler": {"steps": None}})
    trainer.actor_wg = cluster.actor_wg
    trainer.rollouter = _Rollouter.remote(list(cluster.replicas))
    trainer.local_trigger_step, trainer.current_param_version = 1, 0
    trainer.dynamic_schedule_ctx = SimpleNamespace(step_required_samples=4)
    trainer.staleness_threshold, trainer.dynamic_schedule_enabled = 1, False
    trainer.only_hybrid, trainer.timing_raw = False, {}
    trainer._step_wait_times, trainer._step_wait_samples = [], []
    trainer.logger = _Logged()
    return trainer


def test_verls_fully_async_trainer_syncs_staged_through_weightsyncs_manager(cluster) -> None:
    trainer = _fully_async_trainer(cluster, None)  # no class named: weightsync's
    try:
        asyncio.run(trainer._setup_checkpoint_manager())
        assert isinstance(trainer.checkpoint_manager, CheckpointEngineManager)
        assert trainer.checkpoint_manager.stages_syncs()
        for version in (8, 9):  # verl's own _fit_update_weights, as its fit loop calls it
            trainer.current_param_version = version
            expected = cluster.perturb(version)
            timing = asyncio.run(trainer._fit_update_weights())
            assert _served(cluster) == [expected] * 4
            assert timing == {"fully_async/resets": float(version - 7)}
            assert "timing_s/param_sync" in trainer.timing_raw
        status = trainer.checkpoint_manager.weights_status()
        assert {replica["version"] for replica in status.values()} == {9}, status
    finally:
        ray.kill(trainer.rollouter)


def test_the_fully_async_trainer_builds_the_manager_class_its_config_names(cluster) -> None:
    trainer = _fully_async_trainer(cluster, "verl.checkpoint_engine.CheckpointEngineManager")
    try:
        asyncio.run(trainer._setup_checkpoint_manager())
        assert type(trainer.checkpoint_manager) is VerlCheckpointEngineManager
    finally:
        ray.kill(trainer.rollouter)
