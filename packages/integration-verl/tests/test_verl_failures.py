"""weightsync's manager inside verl when a rollout worker dies: the failure names it, and
the sync after removing its replica is bit-exact on the others (its own set of workers:
the process is killed)."""

from __future__ import annotations

import pytest
import ray
from verl.workers.config import CheckpointEngineConfig

from weightsync_core import SyncStageError
from weightsync_verl.scenario import make_cluster, make_manager


@pytest.fixture(scope="module")
def cluster(ray_cluster, model_path):
    config = CheckpointEngineConfig(
        backend="weightsync_nixl", update_weights_bucket_megabytes=1,
        engine_kwargs={"weightsync_nixl": {"timeout": 30}}, custom_backend_module="weightsync_verl",
    )
    cluster = make_cluster(config, model_path, num_trainer=1, num_rollout=3, replica_size=1)
    yield cluster
    cluster.shutdown()


def test_a_dead_rollout_worker_is_named_and_the_others_go_on_without_it(cluster) -> None:
    manager = make_manager(cluster, "weightsync_verl.CheckpointEngineManager")
    expected = cluster.perturb(1)
    manager.update_weights(1)
    doomed = cluster.replicas[1]
    ray.kill(doomed.workers[0])
    cluster.perturb(2)
    with pytest.raises(SyncStageError) as info:
        manager.update_weights(2)
    assert info.value.worker == "rollout rank 1 (replica 1, worker 0)"
    assert "died" in str(info.value)
    manager.remove_replicas([doomed])
    expected = cluster.perturb(3)
    manager.update_weights(3)
    alive = [*cluster.replicas[0].workers, *cluster.replicas[2].workers]
    for report in ray.get([worker.report.remote() for worker in alive]):
        assert report["received"] == expected and report["global_steps"][-1] == 3
