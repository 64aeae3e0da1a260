"""A mixture-of-experts model from three FSDP ranks, its experts one tensor per expert, over
gloo_sharded into a TP=2 replica and an EP=2 replica (the suite's two-rank, fused-experts
case runs on every sharded backend); and a sender that dies mid-stream of an MoE sync."""

from __future__ import annotations

import pytest
import ray

from weightsync_core.api.errors import SyncStageError
from weightsync_core.data.shards import fsdp_spec, moe_spec
from weightsync_core.testing import ShardedDeliveryConformanceTests
from weightsync_core.testing.harness import SyncHarness
from weightsync_core.testing.weights import MOE, Faults

_ONLY_MOE = ("this class runs the mixture-of-experts cases from three ranks; the others run "
             "from two in test_conformance.py")


class TestMoEFromThreeFsdpRanks(ShardedDeliveryConformanceTests):
    backend = "gloo_sharded"
    actor_world_size = 3
    replica_sizes = (2,)
    moe_storage = "moe"
    skipped_cases = {  # noqa: RUF012
        name: _ONLY_MOE for name in dir(ShardedDeliveryConformanceTests)
        if name.startswith("test_") and "_moe_" not in name}

    @pytest.mark.parametrize("storage", ["moe", "moe_fused"])
    def test_moe_sender_that_dies_is_blamed_and_the_next_sync_is_exact(
            self, harness: SyncHarness, storage: str) -> None:
        """Actor rank 1 dies after five of its pieces of an MoE sync (its experts per expert,
        or fused and streamed per expert): the sync fails within its timeout naming it; once
        it is replaced, the next sync delivers every worker its slices bit-exact."""
        replicas = harness.replicas
        layouts = [moe_spec(MOE, 2, rank) for rank in range(2)]
        fused = storage == "moe_fused"
        with self._sharded(harness, replicas, layouts, fused_experts=fused):
            harness.set_weights(seed=83, profile=storage)
            ray.get(harness.actors[1].set_weights.remote(83, storage, Faults(die_after=5)))
            manager = harness.manager(sync_timeout_seconds=self.failure_timeout_seconds)
            try:
                with pytest.raises(SyncStageError) as info:
                    manager.update_weights_sync(global_steps=83, allow_manifest_change=True)
            finally:
                harness.replace_actor(1)
            assert info.value.worker == "actor_wg rank 1", str(info.value)
            ray.get(harness.actors[1].set_layout.remote(
                fsdp_spec(len(harness.actors), 1, fused)))
            self._sync_and_check(harness, harness.manager(), 84, replicas, layouts,
                                 allow_manifest_change=True, profile=storage)
