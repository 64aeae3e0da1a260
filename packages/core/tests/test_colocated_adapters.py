"""LoRA adapter syncs through the colocated engine (``naive``): the actor's workers are the
replicas (one per rank, as weightsync-trainer's colocated mode builds them), and each rank's
in-process server adds every version beside the ones it serves, the newest two kept; a
refused or failed sync leaves each serving what it served."""

from collections.abc import Iterator
from typing import Any

import pytest

from weightsync_core import AdapterSpec, CheckpointEngineConfig, SyncStageError
from weightsync_core.orchestration.ray_group import RayRolloutReplica
from weightsync_core.testing import SyncHarness
from weightsync_core.testing.adapter_suite import set_actor_adapter
from weightsync_core.testing.weights import Faults

SPEC = AdapterSpec("policy", 4, 8.0, ("q_proj", "v_proj"))


@pytest.fixture(scope="module")
def harness() -> Iterator[SyncHarness]:
    config = CheckpointEngineConfig(backend="naive", update_weights_bucket_megabytes=1,
                                    sync_timeout_seconds=30, adapter_versions=2)
    deployment = SyncHarness(config, actor_world_size=2)
    try:
        yield deployment
    finally:
        deployment.shutdown()


def _served(harness: SyncHarness) -> list[dict[int, Any]]:
    return [report["adapters"].get(SPEC.name, {}) for report in harness.reports()]


def test_each_ranks_server_keeps_the_newest_versions_and_a_failure_keeps_them(harness):
    replicas = [RayRolloutReplica([actor], name=f"colocated-{rank}")
                for rank, actor in enumerate(harness.actors)]
    with pytest.raises(TypeError, match="no replicas"):
        harness.manager([]).update_adapter_sync(1, SPEC.name)
    manager = harness.manager(replicas)
    expected, updates = {}, []
    for step, fraction in ((1, 0.0), (2, 0.3), (3, 0.02)):
        if fraction:
            updates.append((step, fraction))
        expected[step] = set_actor_adapter(harness, SPEC, list(updates))
        metrics = manager.update_adapter_sync(step, SPEC.name)
        assert metrics["weightsync/adapter_versions"] == min(step, 2)
    assert _served(harness) == [{2: expected[2], 3: expected[3]}] * 2
    assert manager.adapter_status() == {"replica 0": {"policy": [2, 3]},
                                        "replica 1": {"policy": [2, 3]}}
    set_actor_adapter(harness, AdapterSpec(SPEC.name, 8, 16.0, SPEC.target_modules))
    with pytest.raises(SyncStageError, match="check_adapter") as refused:
        manager.update_adapter_sync(4, SPEC.name)
    assert "rank 4" in str(refused.value) and "rank 8" in str(refused.value)
    set_actor_adapter(harness, SPEC, [*updates, (4, 0.3)], faults=Faults(raise_after=3))
    with pytest.raises(SyncStageError, match="injected failure"):
        manager.update_adapter_sync(4, SPEC.name)
    assert _served(harness) == [{2: expected[2], 3: expected[3]}] * 2
    fourth = set_actor_adapter(harness, SPEC, [*updates, (4, 0.3)])
    manager.update_adapter_sync(4, SPEC.name)
    assert _served(harness) == [{3: expected[3], 4: fourth}] * 2
