"""The core conformance suite for ``kimi``: 2 actor ranks (both serving their share), replicas
of 1 and 2 workers, Mooncake over TCP and gloo inside a replica, real Ray actors."""

import pytest
import ray

from weightsync_core import SyncStageError, passes_in
from weightsync_core.spi import from_wire
from weightsync_core.testing import (
    AdapterSyncConformanceTests,
    CheckpointEngineConformanceTests,
    ConnectionStormTests,
    DeltaSyncConformanceTests,
)
from weightsync_core.testing.harness import SyncHarness
from weightsync_kimi.topology import KimiMetadata


class TestKimiConformance(CheckpointEngineConformanceTests, DeltaSyncConformanceTests,
                          AdapterSyncConformanceTests, ConnectionStormTests):
    backend = "kimi"
    engine_kwargs = {"protocol": "tcp", "collective": "gloo"}  # noqa: RUF012
    actor_world_size = 2
    replica_sizes = (1, 2)
    case_processes = {  # noqa: RUF012  (booted ahead of the case, see the suite)
        "test_replica_added_after_an_update_loads_the_cache_without_sending": (("replica", 2),),
        "test_delta_shares_are_diffed_per_rank_and_no_cache_for_a_late_replica": (
            ("replica", 1),),
    }

    def test_each_bucket_is_hashed_as_it_is_packed_and_as_it_is_copied_out(
        self, harness: SyncHarness
    ) -> None:
        expected = harness.set_weights(seed=32)
        metrics = harness.manager().update_weights_sync(global_steps=32)
        self.assert_delivered(harness, expected)
        passes = set(passes_in(metrics))
        assert {"pack", "copy_out_checksum"} <= passes
        assert not passes & {"sender_checksum", "copy_out", "receiver_checksum"}

    def test_every_actor_rank_serves_a_share(self, harness: SyncHarness) -> None:
        expected = harness.set_weights(seed=30)
        harness.manager().update_weights_sync(global_steps=30)
        self.assert_delivered(harness, expected)
        shares = [  # what each actor rank announces: plain data, rebuilt typed
            from_wire(ray.get(actor.execute_checkpoint_engine.remote("prepare")),
                      KimiMetadata).cache
            for actor in harness.actors
        ]
        assert [share.owner for share in shares] == [0, 1]
        assert all(share.buckets and share.global_steps == 30 for share in shares)
        names = [name for share in shares for name, _, _ in share.tensors]
        assert sorted(names) == sorted(expected)  # disjoint shares covering every tensor

    def test_replica_added_after_an_update_loads_the_cache_without_sending(
        self, harness: SyncHarness
    ) -> None:
        manager = harness.manager()
        expected = harness.set_weights(seed=31)
        manager.update_weights_sync(global_steps=31)
        streams = [ray.get(a.report.remote())["weight_streams"] for a in harness.actors]

        late = harness.new_replica(2, name="late")
        try:
            manager.add_replicas([late])
            metrics = manager.update_replicas_from_cache_sync([late], global_steps=31)
            self.assert_delivered(harness, expected, [late])
            assert metrics["weightsync/tensors"] == len(expected)
            # the actor ranks never iterated their weights again: nothing was sent
            assert [ray.get(a.report.remote())["weight_streams"] for a in harness.actors] \
                == streams
            assert all(r["global_steps"] == [31] for r in harness.reports([late]))
        finally:
            manager.remove_replicas([late])
            for worker in late.workers:
                ray.kill(worker)

    def test_delta_shares_are_diffed_per_rank_and_no_cache_for_a_late_replica(
        self, harness: SyncHarness
    ) -> None:
        manager = harness.manager(delta=True)
        updates = [(70, 0.02)]
        harness.set_weights(seed=70, updates=updates)
        manager.update_weights_sync(global_steps=70)
        updates.append((71, 0.02))
        expected = harness.set_weights(seed=70, updates=updates)
        metrics = manager.update_weights_sync(global_steps=71)
        self.assert_delivered(harness, expected)
        assert metrics["weightsync/delta"] == 1.0
        assert metrics["weightsync/bytes"] < metrics["weightsync/model_bytes"] / 5, metrics
        # each actor rank keeps a copy of its own share only: disjoint, covering the model
        copies = [ray.get(a.report.remote())["delta_copies"] for a in harness.actors]
        assert all(copies) and sorted(copies[0] + copies[1]) == sorted(expected)
        late = harness.new_replica(1, name="late")
        try:
            manager.add_replicas([late])
            with pytest.raises(SyncStageError, match="the last update sent patches"):
                manager.update_replicas_from_cache_sync([late], global_steps=71)
        finally:
            manager.remove_replicas([late])
            for worker in late.workers:
                ray.kill(worker)
