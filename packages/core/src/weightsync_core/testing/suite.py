"""Pytest base classes every backend subclasses with its name (the langchain-tests pattern).

Example, in a backend package's ``tests/test_conformance.py``::

    from weightsync_core.testing import CheckpointEngineConformanceTests

    class TestNixlConformance(CheckpointEngineConformanceTests):
        backend = "nixl"
        engine_kwargs = {"device": "cpu"}

Every test drives real Ray actors through :class:`CheckpointEngineManager` and checks
bit-exact delivery (digests of every tensor) or the failure behaviour.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest
import ray

from weightsync_core.config import CheckpointEngineConfig
from weightsync_core.errors import SyncStageError, SyncTimeoutError
from weightsync_core.testing.harness import SyncHarness
from weightsync_core.testing.weights import Faults

__all__ = ["CheckpointEngineConformanceTests", "ColocatedEngineConformanceTests"]


class _ConformanceBase:
    backend: ClassVar[str] = ""
    """The registered backend name under test (set by the subclass)."""
    engine_kwargs: ClassVar[dict[str, Any]] = {}
    """Constructor arguments for the backend (``engine_kwargs[backend]``)."""
    actor_world_size: ClassVar[int] = 2
    """Number of ``actor_wg`` ranks."""
    bucket_megabytes: ClassVar[int] = 1
    """Small buckets, so that modest tensors span several buckets."""
    timeout_seconds: ClassVar[float] = 60.0
    """The sync timeout of healthy syncs."""
    failure_timeout_seconds: ClassVar[float] = 15.0
    """The sync timeout of syncs expected to fail or hang."""
    replica_sizes: ClassVar[tuple[int, ...]] = (1, 2)
    """Workers per replica: one single-worker replica and one of two (3 workers in all)."""
    ray_actor_options: ClassVar[dict[str, Any]] = {}
    """Extra ``ray.remote`` options of every actor (``{"num_gpus": 1}`` for device engines)."""

    @classmethod
    def make_config(cls, **overrides: Any) -> CheckpointEngineConfig:
        """The config every worker of the harness is built with."""
        fields: dict[str, Any] = {
            "backend": cls.backend,
            "update_weights_bucket_megabytes": cls.bucket_megabytes,
            "engine_kwargs": {cls.backend: dict(cls.engine_kwargs)},
            "sync_timeout_seconds": cls.timeout_seconds,
        }
        fields.update(overrides)
        return CheckpointEngineConfig(**fields)

    @pytest.fixture(scope="class")
    @classmethod
    def harness(cls):
        """One deployment per test class: actor ranks plus replicas of ``replica_sizes``."""
        if not cls.backend:
            pytest.fail("set `backend` on your conformance test class")
        harness = SyncHarness(
            cls.make_config(), cls.actor_world_size, cls.replica_sizes, cls.ray_actor_options
        )
        yield harness
        harness.shutdown()

    @staticmethod
    def assert_delivered(harness: SyncHarness, expected: dict, replicas=None) -> None:
        """Every receiving process got exactly ``expected`` (names, shapes, dtypes, bytes)."""
        reports = harness.reports(replicas)
        assert reports, "no receiving process to check"
        for index, report in enumerate(reports):
            received = report["received"]
            missing = sorted(set(expected) - set(received))
            extra = sorted(set(received) - set(expected))
            wrong = sorted(name for name in expected if name in received
                           and received[name] != expected[name])
            assert not (missing or extra or wrong), (
                f"receiver {index}: missing={missing[:5]} extra={extra[:5]} differing={wrong[:5]}"
            )

    def test_every_dtype_and_shape_bit_exact(self, harness: SyncHarness) -> None:
        expected = harness.set_weights(seed=1)
        dtypes = {spec[1] for spec in expected.values()}
        assert {"torch.float32", "torch.bfloat16", "torch.float16", "torch.int8",
                "torch.int64", "torch.bool", "torch.uint8"} <= dtypes
        harness.manager().update_weights_sync(global_steps=1)
        self.assert_delivered(harness, expected)

    def test_thousands_of_tiny_tensors(self, harness: SyncHarness) -> None:
        expected = harness.set_weights(seed=2, profile="tiny")
        assert len(expected) >= 3000
        harness.manager().update_weights_sync(global_steps=2)
        self.assert_delivered(harness, expected)

    def test_consecutive_syncs_with_changing_global_steps(self, harness: SyncHarness) -> None:
        manager = harness.manager()
        for step in (10, 11, 12):
            expected = harness.set_weights(seed=step)
            manager.update_weights_sync(global_steps=step)
            self.assert_delivered(harness, expected)
        for report in harness.reports():
            assert report["global_steps"][-3:] == [10, 11, 12]

    def test_duplicate_names_are_refused(self, harness: SyncHarness) -> None:
        harness.set_weights(seed=3, faults=Faults(duplicate_name=True))
        manager = harness.manager(sync_timeout_seconds=self.failure_timeout_seconds)
        with pytest.raises(SyncStageError, match=r"duplicate tensor name 'model\.") as info:
            manager.update_weights_sync(global_steps=3)
        assert info.value.stage == "transfer"
        self._recovers(harness)

    def test_non_tensor_values_are_refused(self, harness: SyncHarness) -> None:
        harness.set_weights(seed=4, faults=Faults(non_tensor=True))
        manager = harness.manager(sync_timeout_seconds=self.failure_timeout_seconds)
        with pytest.raises(SyncStageError, match=r"model\.not_a_tensor.*not a torch\.Tensor"):
            manager.update_weights_sync(global_steps=4)
        self._recovers(harness)

    def test_sender_raising_mid_stream_fails_fast_and_names_the_rank(
        self, harness: SyncHarness
    ) -> None:
        harness.set_weights(seed=5, faults=Faults(raise_after=150))
        manager = harness.manager(sync_timeout_seconds=self.failure_timeout_seconds)
        start = time.monotonic()
        with pytest.raises(SyncStageError, match="injected failure") as info:
            manager.update_weights_sync(global_steps=5)
        assert time.monotonic() - start < self.failure_timeout_seconds + 10
        assert info.value.stage == "transfer"
        assert "actor_wg rank 0" in str(info.value)
        self._recovers(harness)

    def _recovers(self, harness: SyncHarness) -> None:
        """After a failed sync, the next one delivers everything."""
        expected = harness.set_weights(seed=99)
        harness.manager().update_weights_sync(global_steps=99)
        self.assert_delivered(harness, expected)


class CheckpointEngineConformanceTests(_ConformanceBase):
    """Conformance for backends that move weights to separate rollout processes."""

    def test_one_rollout_worker(self, harness: SyncHarness) -> None:
        single = [harness.replicas[0]]
        expected = harness.set_weights(seed=20)
        harness.manager(single).update_weights_sync(global_steps=20)
        self.assert_delivered(harness, expected, single)

    def test_tensor_several_times_the_bucket_size(self, harness: SyncHarness) -> None:
        expected = harness.set_weights(seed=21)
        shape, dtype, _ = expected["model.big"]
        assert shape[0] * 4 >= 5 * harness.config.bucket_size_bytes and dtype == "torch.float32"
        metrics = harness.manager().update_weights_sync(global_steps=21)
        assert metrics["weightsync/buckets"] >= 6
        self.assert_delivered(harness, expected)

    def test_metrics_and_replica_lifecycle(self, harness: SyncHarness) -> None:
        expected = harness.set_weights(seed=22)
        metrics = harness.manager().update_weights_sync(global_steps=22)
        sent = ray.get(harness.actors[0].set_weights.remote(22))
        assert metrics["weightsync/bytes"] == pytest.approx(sent, rel=0.01)
        assert metrics["weightsync/tensors"] == len(expected)
        for stage in ("prepare", "init_process_group", "transfer", "finalize", "total"):
            assert metrics[f"weightsync/seconds/{stage}"] >= 0
        for report in harness.reports():
            assert report["lifecycle"][-3:] == [
                "abort_all_requests", "release_kv_cache", "resume_generation"
            ]

    def test_server_that_keeps_received_tensors_never_sees_them_overwritten(
        self, harness: SyncHarness
    ) -> None:
        workers = [w for replica in harness.replicas for w in replica.workers]
        ray.get([worker.set_faults.remote(keep=True) for worker in workers])
        try:
            for step in (27, 28):
                expected = harness.set_weights(seed=step)
                harness.manager().update_weights_sync(global_steps=step)
                self.assert_delivered(harness, expected)
            # neither later buckets nor the next sync overwrote what the servers kept
            assert [r["changed_kept_tensors"] for r in harness.reports()] == [[]] * len(workers)
        finally:
            ray.get([worker.set_faults.remote() for worker in workers])

    def test_replica_removed_and_another_added_between_syncs(
        self, harness: SyncHarness
    ) -> None:
        first, second = harness.replicas[0], harness.replicas[1]
        manager = harness.manager([first, second])
        expected = harness.set_weights(seed=25)
        manager.update_weights_sync(global_steps=25)
        self.assert_delivered(harness, expected, [first, second])
        pids = {report["pid"] for report in harness.reports([second])}

        newcomer = harness.new_replica(2, name="newcomer")
        try:
            manager.remove_replicas([first])
            manager.add_replicas([newcomer])
            expected = harness.set_weights(seed=26)
            manager.update_weights_sync(global_steps=26)
            self.assert_delivered(harness, expected, [second, newcomer])
            # the replica that stayed kept its processes (no restart) and got both versions
            assert {report["pid"] for report in harness.reports([second])} == pids
            assert all(r["global_steps"][-2:] == [25, 26] for r in harness.reports([second]))
            assert all(r["global_steps"] == [26] for r in harness.reports([newcomer]))
        finally:
            for worker in newcomer.workers:
                ray.kill(worker)

    def _sync_with_a_broken_replica(
        self, harness: SyncHarness, error: type[Exception], timeout: float, **faults: int
    ):
        """Sync a healthy replica plus a new one whose server misbehaves as ``faults`` says;
        check the sync raises ``error`` within the timeout. Returns the manager, the healthy
        and the broken replica, and the error."""
        broken = harness.new_replica(1, name="broken")
        ray.get(broken.workers[0].set_faults.remote(**faults))
        healthy = harness.replicas[0]
        manager = harness.manager([healthy, broken], sync_timeout_seconds=timeout)
        harness.set_weights(seed=23)
        start = time.monotonic()
        with pytest.raises(error) as info:
            manager.update_weights_sync(global_steps=23)
        assert time.monotonic() - start < timeout + 15
        assert info.value.stage == "transfer"
        return manager, healthy, broken, info.value

    def _survivors_sync(self, harness: SyncHarness, manager, healthy, broken) -> None:
        manager.remove_replicas([broken])
        expected = harness.set_weights(seed=24)
        manager.update_weights_sync(global_steps=24)
        assert manager.stale_replicas == []
        self.assert_delivered(harness, expected, [healthy])

    def test_stalled_receiver_times_out_instead_of_hanging(self, harness: SyncHarness) -> None:
        manager, healthy, broken, error = self._sync_with_a_broken_replica(
            harness, SyncTimeoutError, timeout=8, stall_after=5
        )
        assert "rollout rank 1 (replica 1, worker 0)" in error.pending
        assert manager.stale_replicas == [healthy, broken]
        ray.kill(broken.workers[0])
        self._survivors_sync(harness, manager, healthy, broken)

    def test_receiver_that_dies_fails_the_sync_then_survivors_sync(
        self, harness: SyncHarness
    ) -> None:
        manager, healthy, broken, error = self._sync_with_a_broken_replica(
            harness, SyncStageError, timeout=30, die_after=5
        )
        assert "replica 1" in str(error)
        self._survivors_sync(harness, manager, healthy, broken)


class ColocatedEngineConformanceTests(_ConformanceBase):
    """Conformance for colocated engines (actor and rollout share each process)."""

    actor_world_size: ClassVar[int] = 2
