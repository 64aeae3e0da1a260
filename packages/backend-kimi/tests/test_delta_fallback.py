"""kimi's refused cache load after a delta sync (the actor ranks' shares are patches, no cache
for a replica added since) does not cost the other replicas their patches: the next sync
patches the replicas that hold the actor side's version and sends whole tensors to the one
that could not load. Real Ray actors, Mooncake over TCP, gloo inside a replica."""

from collections.abc import Iterator

import pytest
import ray

from weightsync_core import CheckpointEngineConfig, SyncStageError
from weightsync_core.testing.harness import SyncHarness

_SEED = 80
_SPARSE = 0.02


@pytest.fixture(scope="module")
def harness() -> Iterator[SyncHarness]:
    """Two actor ranks (each serving its share) and one replica of one worker."""
    config = CheckpointEngineConfig(
        backend="kimi", update_weights_bucket_megabytes=1,
        engine_kwargs={"kimi": {"protocol": "tcp", "collective": "gloo"}},
        sync_timeout_seconds=60,
    )
    deployment = SyncHarness(config, actor_world_size=2, replica_sizes=(1,))
    try:
        yield deployment
    finally:
        deployment.shutdown()


def test_refused_cache_load_then_patches_where_possible(harness: SyncHarness) -> None:
    first = harness.replicas[0]
    manager = harness.manager([first], delta=True)
    updates: list[tuple[int, float]] = []

    def sync(step: int) -> float:
        updates.append((_SEED + step, _SPARSE))
        expected = harness.set_weights(seed=_SEED, updates=updates)
        delta = manager.update_weights_sync(global_steps=step)["weightsync/delta"]
        for report in harness.reports(manager.replicas):
            assert report["received"] == expected, f"step {step}: not bit-exact"
            assert report["global_steps"][-1] == step
        return delta

    assert sync(1) == 0.0
    assert sync(2) == 1.0
    late = harness.new_replica(1, name="late")
    try:
        manager.add_replicas([late])
        with pytest.raises(SyncStageError, match="the last update sent patches"):
            manager.update_replicas_from_cache_sync([late], global_steps=2)
        # the first replica keeps its patches; the late one gets whole tensors, then patches
        assert sync(3) == 0.5
        assert manager.stale_replicas == []
        assert sync(4) == 1.0
    finally:
        manager.remove_replicas([late])
        for worker in late.workers:
            ray.kill(worker)
