"""Conformance cases of delta sync (``CheckpointEngineConfig.delta``), for backends whose
engine sets ``supports_delta``. Mix into the backend's conformance class (one deployment
serves both)::

    class TestNixlConformance(CheckpointEngineConformanceTests, DeltaSyncConformanceTests):
        backend = "nixl"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import pytest
import ray

from weightsync_core.api.errors import SyncStageError
from weightsync_core.testing.harness import SyncHarness
from weightsync_core.testing.suite import _ConformanceBase
from weightsync_core.testing.weights import ONE_ELEMENT, Faults

if TYPE_CHECKING:
    from weightsync_core.orchestration.manager import CheckpointEngineManager

__all__ = ["DeltaSyncConformanceTests"]

_SEED = 60
_SPARSE = 0.02


class DeltaSyncConformanceTests(_ConformanceBase):
    """Delta syncs end bit-exact, move less, and fall back to full copies wherever a
    receiver might not hold the sender's version."""

    case_processes: ClassVar[Mapping[str, Sequence[tuple[str, int]]]] = {
        "test_delta_added_replica_gets_a_full_copy_then_deltas": (("replica", 1),),
        "test_delta_failed_whole_copy_round_leaves_the_patched_replica_serving": (
            ("replica", 1),),
    }

    def _delta_manager(self, harness: SyncHarness, replicas=None,
                       **overrides) -> CheckpointEngineManager:
        return harness.manager(replicas, delta=True, **overrides)

    def _sync(self, harness: SyncHarness, manager: CheckpointEngineManager,
              updates: list[tuple[int, float]], step: int, replicas=None,
              whole: bool = False) -> dict[str, float]:
        """Sync the weights of ``_SEED`` after ``updates`` (``whole``: as whole tensors to
        everyone, ``allow_manifest_change``); check every receiver of ``replicas`` (default:
        all) got them bit-exact."""
        expected = harness.set_weights(seed=_SEED, updates=updates)
        metrics = manager.update_weights_sync(global_steps=step, allow_manifest_change=whole)
        self.assert_delivered(harness, expected, replicas)
        return metrics

    def test_delta_syncs_end_bit_exact_and_move_less(self, harness: SyncHarness) -> None:
        manager = self._delta_manager(harness)
        updates: list[tuple[int, float]] = []
        first = self._sync(harness, manager, updates, 100)
        assert first["weightsync/delta"] == 0.0  # nothing to diff against yet
        assert first["weightsync/changed_fraction"] == 1.0
        fractions = [0.0, 1.0, ONE_ELEMENT, _SPARSE, 0.3, 0.0, _SPARSE, _SPARSE, _SPARSE]
        for offset, fraction in enumerate(fractions, start=1):
            updates.append((_SEED + offset, fraction))
            metrics = self._sync(harness, manager, updates, 100 + offset)
            assert metrics["weightsync/delta"] == 1.0, (offset, metrics)
            changed = metrics["weightsync/changed_fraction"]
            if fraction == 0.0:
                assert changed == 0.0
                # headers only: 32 bytes per tensor
                assert metrics["weightsync/bytes"] <= 40 * metrics["weightsync/tensors"]
            elif fraction == _SPARSE:
                assert 0.0 < changed < 0.05, changed
                assert metrics["weightsync/bytes"] < metrics["weightsync/model_bytes"] / 5
            elif fraction == 1.0:
                assert changed > 0.9, changed
        for report in harness.reports():
            assert report["global_steps"][-10:] == list(range(100, 110))

    def test_delta_servers_own_what_they_are_given(self, harness: SyncHarness) -> None:
        """Servers that keep every tensor they were given, all but the first (all, where
        there is one) converting each in place as they load it: ten delta syncs succeed
        bit-exact, and nothing a server kept changed after it had it."""
        workers = [w for replica in harness.replicas for w in replica.workers]
        converters = workers[1:] or workers
        ray.get([w.set_faults.remote(keep=True, convert=w in converters) for w in workers])
        try:
            manager = self._delta_manager(harness)
            updates = [(_SEED + 60, _SPARSE)]
            self._sync(harness, manager, updates, 160)
            for step in range(161, 171):
                updates.append((_SEED + step - 100, _SPARSE))
                assert self._sync(harness, manager, updates, step)["weightsync/delta"] == 1.0
            assert [r["changed_kept_tensors"] for r in harness.reports()] == [[]] * len(workers)
        finally:
            ray.get([w.set_faults.remote() for w in workers])

    def test_delta_tampered_copy_is_caught_named_then_healed(
        self, harness: SyncHarness
    ) -> None:
        manager = self._delta_manager(harness, sync_timeout_seconds=self.failure_timeout_seconds)
        updates = [(_SEED + 20, _SPARSE)]
        self._sync(harness, manager, updates, 120)
        victim = harness.replicas[-1].workers[-1]
        ray.get(victim.tamper_delta_baseline.remote("model.embed.weight"))
        updates.append((_SEED + 21, _SPARSE))
        harness.set_weights(seed=_SEED, updates=updates)
        before = self.lifecycles(harness)
        with pytest.raises(SyncStageError, match=r"'model\.embed\.weight' rebuilt from its "
                           r"delta .* not the sender's") as info:
            manager.update_weights_sync(global_steps=121)
        worker_names = [w for r in harness.replicas for w in r.workers]
        rank = worker_names.index(victim)
        assert info.value.worker is not None and info.value.worker.startswith(
            f"rollout rank {rank} "), str(info.value)
        assert info.value.stage == "transfer"
        # staged: every replica serves the last version, never paused; stop-the-world:
        # every replica was left paused and is reported stale; none serves the mix
        self.assert_failed_sync_left(harness, manager, harness.replicas, before)
        healed = self._sync(harness, manager, updates, 122)
        assert healed["weightsync/delta"] == 0.0  # a full copy for everyone
        assert manager.stale_replicas == []
        updates.append((_SEED + 22, _SPARSE))
        assert self._sync(harness, manager, updates, 123)["weightsync/delta"] == 1.0

    def test_delta_sync_killed_mid_way_then_full(self, harness: SyncHarness) -> None:
        manager = self._delta_manager(harness, sync_timeout_seconds=self.failure_timeout_seconds)
        updates = [(_SEED + 30, _SPARSE)]
        self._sync(harness, manager, updates, 130)
        updates.append((_SEED + 31, _SPARSE))
        harness.set_weights(seed=_SEED, updates=updates, faults=Faults(raise_after=150))
        before = self.lifecycles(harness)
        with pytest.raises(SyncStageError, match="injected failure"):
            manager.update_weights_sync(global_steps=131)
        self.assert_failed_sync_left(harness, manager, harness.replicas, before)
        statuses = ray.get([w.weights_status.remote()
                            for r in harness.replicas for w in r.workers])
        # no copy of a half-patched version is offered as a base; a stop-the-world sync
        # left the servers incomplete, a staged one left them whole on version 130
        assert all(s["delta_version"] is None for s in statuses), statuses
        assert all(s["complete"] == manager.stages_syncs() for s in statuses), statuses
        healed = self._sync(harness, manager, updates, 132)
        assert healed["weightsync/delta"] == 0.0
        updates.append((_SEED + 32, _SPARSE))
        assert self._sync(harness, manager, updates, 133)["weightsync/delta"] == 1.0

    def test_delta_added_replica_gets_a_full_copy_then_deltas(
        self, harness: SyncHarness
    ) -> None:
        first = harness.replicas[0]
        manager = self._delta_manager(harness, [first], full_verify_every=4)
        updates = [(_SEED + 40, _SPARSE)]
        # whole, so that the count to the 4th sync starts here (the processes may hold the
        # version of an earlier case's manager, which a first sync would patch against)
        self._sync(harness, manager, updates, 140, [first], whole=True)
        newcomer = harness.new_replica(1, name="newcomer")
        try:
            manager.add_replicas([newcomer])
            both = [first, newcomer]
            deltas = []
            for step in range(141, 146):
                updates.append((_SEED + step, _SPARSE))
                deltas.append(self._sync(harness, manager, updates, step, both)
                              ["weightsync/delta"])
            # the newcomer holds nothing: whole tensors to it, patches to the first replica
            # in the same sync; then patches to both; every 4th sync is full for both
            assert deltas == [0.5, 1.0, 1.0, 0.0, 1.0], deltas
        finally:
            manager.remove_replicas([newcomer])
            for worker in newcomer.workers:
                ray.kill(worker)

    def test_delta_failed_whole_copy_round_leaves_the_patched_replica_serving(
        self, harness: SyncHarness
    ) -> None:
        first = harness.replicas[0]
        manager = self._delta_manager(harness, [first],
                                      sync_timeout_seconds=self.failure_timeout_seconds)
        updates = [(_SEED + 50, _SPARSE)]
        self._sync(harness, manager, updates, 150, [first])
        newcomer = harness.new_replica(1, name="newcomer")
        try:
            ray.get(newcomer.workers[0].set_faults.remote(die_after=1))
            manager.add_replicas([newcomer])
            updates.append((_SEED + 51, _SPARSE))
            served = harness.reports([first])
            before = self.lifecycles(harness, [first])
            expected = harness.set_weights(seed=_SEED, updates=updates)
            with pytest.raises(SyncStageError, match=r"in the round of whole tensors to "
                               r"replica\(s\) \[1\] of this manager") as info:
                manager.update_weights_sync(global_steps=151)
            assert info.value.stage == "transfer"
            if manager.stages_syncs():
                # the fleet commits together or not at all: the first replica's stage of
                # patches was discarded, and it serves the version it had, never paused
                self.assert_failed_sync_left(harness, manager, [first, newcomer], before,
                                             [first])
                assert [r["received"] for r in harness.reports([first])] == [
                    r["received"] for r in served]
            else:
                assert "the 1 other replica(s) were resumed" in str(info.value)
                # the first replica got its patches in the round before, and serves them
                assert [id(r) for r in manager.stale_replicas] == [id(newcomer)]
                self.assert_delivered(harness, expected, [first])
                for report in harness.reports([first]):
                    assert report["lifecycle"][-2:] == ["resume_kv_cache", "resume_generation"]
        finally:
            manager.remove_replicas([newcomer])
            for worker in newcomer.workers:
                ray.kill(worker)
        healed = self._sync(harness, manager, updates, 152, [first])
        assert healed["weightsync/delta"] == 0.0  # the actor side's copy is not trusted
