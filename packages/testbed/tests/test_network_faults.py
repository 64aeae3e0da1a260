"""Network faults on the testbed, for gloo, nixl and mooncake: each sync under a fault
either completes bit-exact or fails within its timeout naming a host the fault cut off;
never a hang; and the next sync (fault repaired, or the cut-off replica removed) is
bit-exact everywhere.

Each line the tests print (``[backend] fault: outcome``) is a row of the table in the docs'
testbed page (docs/testbed.md, "Network faults").
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest
import ray

from weightsync_core import CheckpointEngineConfig, SyncStageError
from weightsync_core.testing import SyncHarness
from weightsync_core.testing.profile import by_profile
from weightsync_testbed import HostPlacement, Testbed, TestbedUnavailableError

ACTORS = ["a0"]
REPLICAS = ["r0", "r1", "r2"]  # replica i on REPLICAS[i]
GRACE_SECONDS = 3.0
"""How far past its timeout a failing sync may return (probe and clean-up)."""
CUT_TIMEOUT = by_profile(default=6.0, long=10.0)
"""The sync timeout of the syncs that a partition or a cut cable can only end at their
timeout: a healthy sync here takes 0.3-4 s (5% loss included; docs/testbed.md), and the cable
is cut after the third tensor, within about a second."""


class _NetworkFaults:
    backend: ClassVar[str] = ""
    engine_kwargs: ClassVar[dict[str, Any]] = {}
    timeout_seconds: ClassVar[float] = 20.0

    @pytest.fixture(scope="class")
    @classmethod
    def harness(cls, testbed: Testbed):
        config = CheckpointEngineConfig(
            backend=cls.backend, update_weights_bucket_megabytes=1,
            engine_kwargs={cls.backend: dict(cls.engine_kwargs)},
            sync_timeout_seconds=cls.timeout_seconds,
        )
        harness = SyncHarness(config, actor_world_size=len(ACTORS),
                              replica_sizes=(1,) * len(REPLICAS),
                              placement=HostPlacement(ACTORS, REPLICAS))
        yield harness
        harness.shutdown()

    # -- helpers -----------------------------------------------------------------------------
    def _sync_under_fault(
        self, testbed: Testbed, harness: SyncHarness, fault: str, step: int,
        cut_off: set[str], replicas=None, timeout: float | None = None,
    ) -> str:
        """One sync while the fault is in place: bit-exact, or a failure within the
        timeout that names a host in ``cut_off``. Returns the outcome for the table."""
        timeout = timeout or self.timeout_seconds
        manager = harness.manager(replicas, sync_timeout_seconds=timeout)
        expected = harness.set_weights(seed=step)
        start = time.monotonic()
        try:
            manager.update_weights_sync(global_steps=step)
        except SyncStageError as error:
            elapsed = time.monotonic() - start
            host = testbed.host_of(error.host or "")
            outcome = (f"failed after {elapsed:.1f}s (timeout {timeout:.0f}s), blamed "
                       f"{error.worker} on host {host}")
            print(f"\n[{self.backend}] {fault}: {outcome}")
            assert elapsed < timeout + GRACE_SECONDS, f"{fault}: {outcome}: {error}"
            assert host in cut_off, f"{fault}: blamed host {host}, not one of {cut_off}: {error}"
            # stop-the-world, the replicas it wrote into are stale; staged, none: a failure
            # before the switch leaves every replica serving its version
            wrote = error.stage in ("transfer", "finalize") and not manager.stages_syncs()
            assert manager.stale_replicas == (list(replicas or harness.replicas) if wrote
                                              else []), (
                "a failed sync lists every replica it wrote into as stale (stop-the-world), "
                "and none that still serves (a staged sync, or one that failed before any "
                f"byte moved; it failed at {error.stage!r})")
            return outcome
        elapsed = time.monotonic() - start
        _assert_delivered(harness, expected, replicas)
        outcome = f"completed bit-exact in {elapsed:.1f}s"
        print(f"\n[{self.backend}] {fault}: {outcome}")
        return outcome

    def _next_sync_exact(self, harness: SyncHarness, step: int, replicas=None) -> None:
        expected = harness.set_weights(seed=step)
        manager = harness.manager(replicas)
        manager.update_weights_sync(global_steps=step)
        assert manager.stale_replicas == []
        _assert_delivered(harness, expected, replicas)

    # -- the faults ----------------------------------------------------------------------------
    def test_five_percent_packet_loss_on_a_receiver_host(self, testbed, harness) -> None:
        testbed.set_loss("r1", 5)
        try:
            self._sync_under_fault(testbed, harness, "5% loss on r1", 101, {"r1"})
        finally:
            testbed.set_loss("r1", 0)
        self._next_sync_exact(harness, 102)

    def test_partition_between_two_replica_hosts(self, testbed, harness) -> None:
        testbed.partition("r0", "r1")
        try:
            self._sync_under_fault(testbed, harness, "partition r0 | r1", 103, {"r0", "r1"},
                                   timeout=CUT_TIMEOUT)
        finally:
            testbed.heal("r0", "r1")
        self._next_sync_exact(harness, 104)

    def test_fifty_ms_delay_on_a_receiver_host(self, testbed, harness) -> None:
        try:
            testbed.set_delay("r1", 50)
        except TestbedUnavailableError as exc:
            pytest.skip(f"cannot add delay on this kernel: {exc}")
        try:
            self._sync_under_fault(testbed, harness, "50 ms delay on r1", 105, {"r1"})
        finally:
            testbed.set_delay("r1", 0)
        self._next_sync_exact(harness, 106)

    def test_receiver_host_link_down_mid_sync(self, testbed, harness) -> None:
        victim = harness.replicas[REPLICAS.index("r2")]
        worker = victim.workers[0]
        ray.get(worker.set_faults.remote(delay_per_tensor=0.02))  # a sync of a few seconds

        def receiving() -> bool:
            progress = ray.get(worker.execute_checkpoint_engine.remote("sync_progress"),
                               timeout=1)
            return progress["state"] != "idle" and progress["tensors"] >= 3

        with testbed.fault_when(receiving, lambda: testbed.link_down("r2")) as injected:
            outcome = self._sync_under_fault(testbed, harness, "link of r2 down mid-sync",
                                             107, {"r2"}, timeout=CUT_TIMEOUT)
        assert injected.is_set(), "the sync ended before the link could be cut"
        assert outcome.startswith("failed"), "a sync completed without a receiver's link"
        try:
            survivors = [r for r in harness.replicas if r is not victim]
            self._next_sync_exact(harness, 108, survivors)
        finally:
            testbed.link_up("r2")
            ray.kill(worker)


def _assert_delivered(harness: SyncHarness, expected: dict, replicas=None) -> None:
    for index, report in enumerate(harness.reports(replicas)):
        assert report["received"] == expected, f"receiver {index} is not bit-exact"


class TestGlooNetworkFaults(_NetworkFaults):
    backend = "gloo"


class TestNixlNetworkFaults(_NetworkFaults):
    backend = "nixl"
    engine_kwargs: ClassVar[dict[str, Any]] = {"device": "cpu", "ucx_transports": "tcp"}


class TestMooncakeNetworkFaults(_NetworkFaults):
    backend = "mooncake"
    engine_kwargs: ClassVar[dict[str, Any]] = {"protocol": "tcp"}
