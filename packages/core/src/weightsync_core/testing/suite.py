"""Pytest base classes every backend subclasses with its name (the langchain-tests pattern).

Example, in a backend package's ``tests/test_conformance.py``::

    from weightsync_core.testing import CheckpointEngineConformanceTests

    class TestNixlConformance(CheckpointEngineConformanceTests):
        backend = "nixl"
        engine_kwargs = {"device": "cpu"}

Every test drives real Ray actors through :class:`CheckpointEngineManager` and checks
bit-exact delivery (digests of every tensor) or the failure behaviour.

A subclass that cannot or need not run a case skips it with a reason, in ``skipped_cases``
(test name -> reason); each shows as a skip with its reason in ``pytest -rs``::

    class TestGlooRelayConformance(CheckpointEngineConformanceTests):
        backend = "gloo"
        skipped_cases = {  # noqa: RUF012
            "test_sender_that_dies_is_blamed": "runs once, without relays (TestGlooConformance)",
        }

``skipped_cases`` of every class in the MRO count (so a mixin can skip cases too). Switching a
case off by assigning ``test_... = None`` is refused with a ``TypeError`` when the class is
defined, and so is a ``skipped_cases`` entry that names no case of the suite, or gives no reason.

Booting Ray processes is most of the suite's time, so processes are started ahead of need: the
ones a case adds (``case_processes``, :meth:`SyncHarness.prestart`) while earlier cases run,
and the next class's deployment while the case before runs. Every case
still gets fresh processes where it got them before.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import pytest
import ray

from weightsync_core.api.config import CheckpointEngineConfig
from weightsync_core.api.errors import SyncStageError, SyncTimeoutError
from weightsync_core.testing.harness import SyncHarness
from weightsync_core.testing.profile import by_profile
from weightsync_core.testing.weights import Faults

if TYPE_CHECKING:
    from weightsync_core.orchestration.manager import CheckpointEngineManager
    from weightsync_core.orchestration.ray_group import RayRolloutReplica

__all__ = [
    "CheckpointEngineConformanceTests",
    "ColocatedEngineConformanceTests",
    "ControlFrameReplayTests",
]

_StageError = TypeVar("_StageError", bound=SyncStageError)

DEFAULT_SOAK_SYNCS = 40
"""The most syncs a soak runs in the default profile: a descriptor, thread or connection kept
per sync grows a process by 40, five times :attr:`~_ConformanceBase.soak_bounds` or more;
the long profile runs :attr:`~_ConformanceBase.soak_syncs`."""
SOAK_RSS_FLOOR = 8 << 20
"""A shorter soak (the default profile) bounds memory growth per sync as the long one does
(:attr:`~_ConformanceBase.soak_bounds` over :attr:`~_ConformanceBase.soak_syncs`), but at
least by this much (allocator noise; 0.7-1.2 MiB measured over 40 syncs): 8 MiB over 40
syncs where the long profile allows 32 MiB over 200, so a state dict of the soak (256 KiB)
kept per sync shows in both."""
SOAK_WINDOWS = 2
"""Windows of syncs a soak measures, each against the bounds: what grows per sync grows in
every window, what a process allocates once (a thread's malloc arena, a lazily built cache:
kimi's first window after its warm-up grows one thread and 8-14 MiB, its next four 0.2-1.5 MiB
each) in one only. The soak fails when every window grows past a bound and stops at the first
window within all of them."""
DEFAULT_REPLAY_SYNCS = 20
STALL_TIMEOUT = by_profile(default=4, long=8)
"""The sync timeout of the cases whose receiver stalls or is frozen mid-sync: a healthy sync of
these cases takes 0.3-3 s on a loaded 2-core machine, so 4 s in the default profile."""
SLOW_TIMEOUT = by_profile(default=8, long=8)
"""The sync timeout of the case whose receiver takes a second per tensor (about a minute for
the case's weights). 4 s failed once on nixl_sharded at a load of 10 on 2 cores: every
process was still setting up the sync at the timeout, so none stood out to blame."""
"""The most syncs the replay cases run in the default profile (the long one:
:attr:`ControlFrameReplayTests.replay_syncs`)."""


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
    weights_profile: ClassVar[str] = "standard"
    """The weights the cases sync unless a case needs others: ``rollout_floats`` for an
    engine that casts every tensor to its rollout dtype and fits each in one bucket
    (:func:`~weightsync_core.testing.weights.make_weights`)."""
    ray_actor_options: ClassVar[dict[str, Any]] = {}
    """Extra ``ray.remote`` options of every actor (``{"num_gpus": 1}`` for device engines)."""
    soak_syncs: ClassVar[int] = 200
    """Syncs of the soak test (each of a small state dict) in the long profile; the default
    profile runs at most :data:`DEFAULT_SOAK_SYNCS` of them
    (:mod:`~weightsync_core.testing.profile`)."""
    soak_bounds: ClassVar[dict[str, float]] = {
        "fds": 8, "threads": 1, "established": 2, "rss": 32 << 20,
    }
    """How much each process may gain over the soak (after a warm-up)."""
    case_processes: ClassVar[Mapping[str, Sequence[tuple[str, int]]]] = {}
    """The processes each case starts beyond the class's deployment, in order:
    ``("replica", size)`` per ``harness.new_replica(size)``, ``("actor", rank)`` per
    ``harness.replace_actor(rank)``. The ``harness`` fixture starts them ahead of need
    (:meth:`SyncHarness.prestart`) for the cases pytest will run. Entries of every class in
    the MRO count; a case missing here still works, it only boots its processes itself."""
    skipped_cases: ClassVar[Mapping[str, str]] = {}
    """Cases this class skips: test name -> the reason, shown by ``pytest -rs``. Entries of
    every class in the MRO count. Use this, never ``test_... = None``, which is refused."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        skipped: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            skipped.update(vars(klass).get("skipped_cases", {}))
        for name in dir(cls):
            if name.startswith("test_") and getattr(cls, name) is None and name not in skipped:
                raise TypeError(
                    f"{cls.__qualname__}.{name} = None switches the conformance case off "
                    f"without a reason; skip it with skipped_cases = {{{name!r}: \"why\"}} "
                    "instead (the reason shows in pytest -rs)"
                )
        for name, reason in skipped.items():
            if not (name.startswith("test_")
                    and any(callable(vars(klass).get(name)) for klass in cls.__mro__)):
                raise TypeError(f"{cls.__qualname__}.skipped_cases names {name!r}, which is "
                                "not a case of the conformance suite")
            if not isinstance(reason, str) or not reason.strip():
                raise TypeError(f"{cls.__qualname__}.skipped_cases[{name!r}] must give the "
                                "reason for skipping the case")
            setattr(cls, name, _skipped_case(name, reason))

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

    @classmethod
    def make_harness(cls) -> SyncHarness:
        """A deployment of ``actor_world_size`` ranks and replicas of ``replica_sizes``;
        override to place it (the testbed puts ranks and replicas on emulated hosts)."""
        return SyncHarness(
            cls.make_config(), cls.actor_world_size, cls.replica_sizes, cls.ray_actor_options
        )

    @pytest.fixture(scope="class")
    @classmethod
    def harness(cls, request: pytest.FixtureRequest):
        """One deployment per test class (:meth:`make_harness`), with the processes the
        selected cases will start booted ahead of need (:attr:`case_processes`)."""
        if not cls.backend:
            pytest.fail("set `backend` on your conformance test class")
        _USED.add((cls, "harness"))
        booted = _BOOTED_AHEAD.pop((cls, "harness"), None)
        harness = booted.result() if booted else cls.make_harness()
        harness.weights_profile = cls.weights_profile
        try:
            harness.prestart(need for item in cls._cases_to_run(request.session)
                             for need in cls._case_processes().get(item.originalname, ()))
            yield harness
        finally:
            harness.shutdown()

    @pytest.fixture(autouse=True)
    def _boot_deployments_ahead(self, request: pytest.FixtureRequest):
        """While the last case before it runs, boot the deployment of the next test class
        of the suite: its processes are as fresh, and the boot overlaps the case instead of
        adding to it."""
        items = request.session.items
        if request.node in items:
            position = items.index(request.node)
            for upcoming in items[position + 1:position + 1 + _BOOT_AHEAD_CASES]:
                _boot_ahead(upcoming)
        yield

    @classmethod
    def _case_processes(cls) -> dict[str, Sequence[tuple[str, int]]]:
        merged: dict[str, Sequence[tuple[str, int]]] = {}
        for klass in reversed(cls.__mro__):
            merged.update(vars(klass).get("case_processes", {}))
        return merged

    @classmethod
    def _cases_to_run(cls, session: pytest.Session) -> list[pytest.Function]:
        """This class's cases in the session, in the order pytest runs them, less skipped."""
        return [item for item in session.items
                if isinstance(item, pytest.Function) and item.cls is cls
                and item.get_closest_marker("skip") is None]

    def timed_sync(self, harness: SyncHarness, manager: CheckpointEngineManager, step: int
                   ) -> float:
        """Sync the weights of seed ``step`` and check every receiver got them; the seconds
        the sync took."""
        expected = harness.set_weights(seed=step)
        start = time.monotonic()
        manager.update_weights_sync(global_steps=step)
        seconds = time.monotonic() - start
        self.assert_delivered(harness, expected)
        return seconds

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

    @staticmethod
    def lifecycles(harness: SyncHarness, replicas=None) -> list[list[str]]:
        """Per receiving process: the pause and resume calls its server got so far (none
        recorded where the actor ranks receive: a colocated engine)."""
        return [list(report.get("lifecycle", ())) for report in harness.reports(replicas)]

    @classmethod
    def assert_failed_sync_left(cls, harness: SyncHarness, manager: CheckpointEngineManager,
                                reached: Sequence[RayRolloutReplica],
                                lifecycles: list[list[str]], replicas=None) -> None:
        """After a sync that failed once bytes moved to ``reached``: where the manager
        stages syncs, nothing was paused (``lifecycles`` as before the sync, of
        ``replicas``' processes), no replica is stale, and every worker of ``replicas``
        serves a whole version with nothing staged; in a stop-the-world sync, ``reached``
        are listed stale (paused, not serving the mix)."""
        if harness.colocated:
            return
        if not manager.stages_syncs():
            assert [id(r) for r in manager.stale_replicas] == [id(r) for r in reached]
            return
        assert manager.stale_replicas == []
        assert cls.lifecycles(harness, replicas) == lifecycles, (
            "a failed staged sync paused a replica")
        chosen = harness.replicas if replicas is None else replicas
        statuses = ray.get([worker.weights_status.remote() for replica in chosen
                            for worker in replica.workers])
        assert all(status["complete"] and status["staged_version"] is None
                   for status in statuses), statuses

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
        manager = harness.manager()
        manager.update_weights_sync(global_steps=2, allow_manifest_change=True)
        self.assert_delivered(harness, expected)
        self._restore_standard_layout(harness, manager)

    def _restore_standard_layout(self, harness: SyncHarness, manager) -> None:
        """Sync the standard weights again, announcing the change of layout."""
        expected = harness.set_weights(seed=98)
        manager.update_weights_sync(global_steps=98, allow_manifest_change=True)
        self.assert_delivered(harness, expected)

    def test_empty_weight_stream_fails_and_blames_the_sender(self, harness: SyncHarness) -> None:
        harness.set_weights(seed=6, faults=Faults(empty=True))
        manager = harness.manager(sync_timeout_seconds=self.failure_timeout_seconds)
        with pytest.raises(SyncStageError, match="no tensors") as info:
            manager.update_weights_sync(global_steps=6)
        assert info.value.worker == "actor_wg rank 0", str(info.value)
        assert all(6 not in report["global_steps"] for report in harness.reports())
        self._recovers(harness)

    def test_changed_manifest_is_refused_unless_the_caller_allows_it(
        self, harness: SyncHarness
    ) -> None:
        manager = harness.manager(sync_timeout_seconds=self.failure_timeout_seconds)
        dtype = harness.set_weights(seed=7)["model.embed.weight"][1].removeprefix("torch.")
        manager.update_weights_sync(global_steps=7)
        harness.set_weights(seed=8, faults=Faults(reshape="model.embed.weight"))
        pattern = rf"'model\.embed\.weight' changed from shape \[97, 33\] {dtype} to shape \[3201\]"
        with pytest.raises(SyncStageError, match=pattern):
            manager.update_weights_sync(global_steps=8)
        assert all(8 not in report["global_steps"] for report in harness.reports())
        manager.update_weights_sync(global_steps=9, allow_manifest_change=True)
        assert all(report["global_steps"][-1] == 9 for report in harness.reports())
        expected = harness.set_weights(seed=10)
        manager.update_weights_sync(global_steps=10, allow_manifest_change=True)
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
        before = self.lifecycles(harness)
        start = time.monotonic()
        with pytest.raises(SyncStageError, match="injected failure") as info:
            manager.update_weights_sync(global_steps=5)
        assert time.monotonic() - start < self.failure_timeout_seconds + 10
        assert info.value.stage == "transfer"
        assert "actor_wg rank 0" in str(info.value)
        # bytes had moved: staged, every replica serves its version, never paused;
        # stop-the-world, every replica is stale, none serves the mix
        self.assert_failed_sync_left(harness, manager, harness.replicas, before)
        if not (harness.colocated or manager.stages_syncs()):
            for report in harness.reports():
                assert report["lifecycle"][-1] != "resume_generation", report["lifecycle"]
        self._recovers(harness)

    def _recovers(self, harness: SyncHarness) -> None:
        """After a failed sync, the next one delivers everything."""
        expected = harness.set_weights(seed=99)
        harness.manager().update_weights_sync(global_steps=99)
        self.assert_delivered(harness, expected)


_SOAK = "test_soak_keeps_resources_flat_and_close_frees_every_port"


class _InBackground:
    """``make()`` run on a thread from now on; :meth:`result` waits for what it returned."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._outcome: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(make,), daemon=True)
        self._thread.start()

    def _run(self, make: Callable[[], Any]) -> None:
        try:
            self._outcome[:] = [True, make()]
        except BaseException as exc:  # re-raised by result()
            self._outcome[:] = [False, exc]

    def result(self) -> Any:
        self._thread.join()
        ok, value = self._outcome
        if not ok:
            raise value
        return value


_BOOTED_AHEAD: dict[tuple[type, str], _InBackground] = {}
"""Per test class: its ``"harness"`` (the class fixture's deployment), booting while the case
before runs."""
_BOOT_AHEAD_CASES = 1
"""How many cases ahead a deployment starts booting (the one before it: a boot competes
for the CPU with the timing-bound failure cases)."""


def _boot_ahead(item: pytest.Item) -> None:
    """Start booting the deployment ``item`` will be the first to use, if it is a case of
    the suite that runs (not skipped) and no one booted it yet."""
    cls = getattr(item, "cls", None)
    if not (isinstance(item, pytest.Function) and isinstance(cls, type)
            and issubclass(cls, _ConformanceBase) and cls.backend
            and item.get_closest_marker("skip") is None):
        return
    if item.originalname == _SOAK:
        return  # builds its own deployment when it starts (a booted-ahead one failed the
        # "listening after close" check: a Ray port opened after the baseline was taken)
    if "harness" in item.fixturenames and _ConformanceBase is next(
            klass for klass in cls.__mro__ if "harness" in vars(klass)):
        key = (cls, "harness")  # the suite's own fixture, not a subclass's
    else:
        return
    if key not in _BOOTED_AHEAD and key not in _USED:
        _USED.add(key)
        _BOOTED_AHEAD[key] = _InBackground(cls.make_harness)


_USED: set[tuple[type, str]] = set()
"""Deployments already booted ahead (or built): never booted twice."""


def _skipped_case(name: str, reason: str) -> Callable[..., None]:
    """A stand-in for the case ``name`` that pytest skips with ``reason`` (it asks for no
    fixture, so a class whose every case is skipped starts no deployment)."""

    @pytest.mark.skip(reason=reason)
    def case(self: Any) -> None:
        raise AssertionError(f"{name} is skipped: {reason}")

    case.__name__ = case.__qualname__ = name
    return case


class CheckpointEngineConformanceTests(_ConformanceBase):
    """Conformance for backends that move weights to separate rollout processes."""

    case_processes: ClassVar[Mapping[str, Sequence[tuple[str, int]]]] = {
        "test_replica_removed_and_another_added_between_syncs": (("replica", 2),),
        "test_stalled_receiver_is_blamed_within_the_timeout": (("replica", 1),),
        "test_frozen_receiver_is_blamed_within_the_timeout": (("replica", 1),),
        "test_slow_receiver_past_the_timeout_is_blamed": (("replica", 1),),
        "test_receiver_that_dies_is_blamed_then_survivors_sync": (("replica", 1),),
        "test_sender_that_dies_is_blamed": (("actor", 0),),
    }

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
        sent = ray.get(harness.actors[0].set_weights.remote(22, harness.weights_profile))
        assert metrics["weightsync/bytes"] == pytest.approx(sent, rel=0.01)
        assert metrics["weightsync/tensors"] == len(expected)
        for stage in ("prepare", "init_process_group", "transfer", "finalize", "total"):
            assert metrics[f"weightsync/seconds/{stage}"] >= 0
        manager = harness.manager()
        if manager.stages_syncs():  # paused for the switch only, the KV cache kept
            assert metrics["weightsync/staged"] == 1.0
            assert 0 < metrics["weightsync/pause_seconds"] <= metrics[
                "weightsync/seconds/commit"] <= metrics["weightsync/seconds/total"]
            pause = ["abort_all_requests", "resume_generation"]
        else:
            assert metrics["weightsync/staged"] == 0.0
            pause = ["abort_all_requests", "release_kv_cache", "resume_kv_cache",
                     "resume_generation"]
        for report in harness.reports():
            assert report["lifecycle"][-len(pause):] == pause, report["lifecycle"]

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

    def test_server_refusing_its_switch_is_rolled_back_and_serves(
        self, harness: SyncHarness
    ) -> None:
        """Phase 2 of a staged sync: the last worker's server refuses the staged version
        part-way through loading it. Its replica is rolled back whole (every worker back on
        the version it served, from the copy kept) and resumed, not stale; the other
        replicas serve the new version; the next sync is exact everywhere."""
        manager = harness.manager()
        if not manager.stages_syncs():
            pytest.skip("this deployment's workers do not stage syncs")
        previous = harness.set_weights(seed=30)
        manager.update_weights_sync(global_steps=30)
        *others, refusing = harness.replicas
        ray.get(refusing.workers[-1].set_faults.remote(refuse_after=2))
        expected = harness.set_weights(seed=31)
        with pytest.raises(SyncStageError, match=r"refused tensor.*rolled back to version 30"
                           ) as info:
            manager.update_weights_sync(global_steps=31)
        assert info.value.stage == "commit", str(info.value)
        assert manager.stale_replicas == []
        self.assert_delivered(harness, expected, others)
        self.assert_delivered(harness, previous, [refusing])
        assert self.lifecycles(harness, [refusing])[-1][-2:] == [
            "abort_all_requests", "resume_generation"], "the rolled back replica serves"
        status = manager.weights_status_sync()
        assert [entry["state"] for entry in status.values()] == ["serving"] * len(status)
        assert [entry["version"] for entry in status.values()] == [31] * len(others) + [30]
        self.timed_sync(harness, manager, 32)

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

    # -- failures: who is blamed, and how fast ---------------------------------------------
    def _sync_with_a_broken_replica(
        self, harness: SyncHarness, error: type[_StageError], timeout: float,
        during: Callable[[RayRolloutReplica], None] | None = None, **faults: Any,
    ) -> tuple[CheckpointEngineManager, RayRolloutReplica, RayRolloutReplica, _StageError,
               float]:
        """Sync a healthy replica plus a new one whose server misbehaves as ``faults`` says
        (``during(broken)`` runs on a thread while the sync runs); check the sync raises
        ``error`` blaming the broken worker. Returns the manager, the healthy and the broken
        replica, the error and the seconds it took."""
        broken = harness.new_replica(1, name="broken")
        ray.get(broken.workers[0].set_faults.remote(**faults))
        healthy = harness.replicas[0]
        manager = harness.manager([healthy, broken], sync_timeout_seconds=timeout)
        harness.set_weights(seed=23)
        helper = threading.Thread(target=during, args=(broken,)) if during else None
        start = time.monotonic()
        if helper:
            helper.start()
        try:
            with pytest.raises(error) as info:
                manager.update_weights_sync(global_steps=23)
        finally:
            if helper:
                helper.join(60)
        elapsed = time.monotonic() - start
        assert info.value.stage == "transfer", str(info.value)
        assert info.value.worker == self._broken_worker(healthy), str(info.value)
        return manager, healthy, broken, info.value, elapsed

    @staticmethod
    def _broken_worker(healthy: RayRolloutReplica) -> str:
        """How the manager names the broken replica's worker: replica 1, after ``healthy``'s
        workers in rollout rank order (rollout rank 1 where the healthy replica has one)."""
        return f"rollout rank {len(healthy.workers)} (replica 1, worker 0)"

    def _detected(self, case: str, elapsed: float, bound: float, error: Exception) -> None:
        """Print how long detection took (the figures in the docs) and check the bound."""
        print(f"\n[{self.backend}] {case}: detected after {elapsed:.1f}s (bound {bound:.0f}s); "
              f"blamed {getattr(error, 'worker', None)!r}")
        assert elapsed < bound, f"{case}: detected after {elapsed:.1f}s: {error}"

    def _survivors_sync(self, harness: SyncHarness, manager, healthy, broken) -> None:
        """The same manager's next sync, without ``broken``, under the healthy syncs' timeout
        (the short one of the failure found the culprit; the next sync's time is not what is
        tested, and a slow engine on a busy machine may take longer than it allows)."""
        manager.config = replace(manager.config,
                                 sync_timeout_seconds=harness.config.sync_timeout_seconds)
        manager.remove_replicas([broken])
        expected = harness.set_weights(seed=24)
        manager.update_weights_sync(global_steps=24)
        assert manager.stale_replicas == []
        self.assert_delivered(harness, expected, [healthy])

    def test_stalled_receiver_is_blamed_within_the_timeout(self, harness: SyncHarness) -> None:
        before = self.lifecycles(harness, harness.replicas[:1])
        manager, healthy, broken, error, elapsed = self._sync_with_a_broken_replica(
            harness, SyncTimeoutError, timeout=STALL_TIMEOUT, stall_after=5
        )
        assert f"{self._broken_worker(healthy)} stopped making progress" in str(error)
        assert self._broken_worker(healthy) in error.pending
        self._detected("stalled receiver", elapsed, STALL_TIMEOUT + 2, error)
        self.assert_failed_sync_left(harness, manager, [healthy, broken], before, [healthy])
        ray.kill(broken.workers[0])
        self._survivors_sync(harness, manager, healthy, broken)

    def test_frozen_receiver_is_blamed_within_the_timeout(self, harness: SyncHarness) -> None:
        def freeze(broken: RayRolloutReplica) -> None:
            worker = broken.workers[0]
            # typed refs: Ray's stubs take an untyped actor call for a list of refs
            report: ray.ObjectRef[dict[str, Any]] = worker.report.remote()
            pid = ray.get(report)["pid"]
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # freeze it mid-sync, after a few tensors
                call: ray.ObjectRef[dict[str, Any]] = worker.execute_checkpoint_engine.remote(
                    "sync_progress"
                )
                progress = ray.get(call)
                if progress["tensors"] >= 3:
                    break
                time.sleep(0.02)
            os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)

        frozen: list[int] = []
        try:
            manager, healthy, broken, error, elapsed = self._sync_with_a_broken_replica(
                harness, SyncTimeoutError, timeout=STALL_TIMEOUT, during=freeze,
                delay_per_tensor=0.05,
            )
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        assert frozen, "the receiver finished before it could be frozen"
        assert f"{self._broken_worker(healthy)} stopped responding" in str(error)
        self._detected("frozen receiver (SIGSTOP)", elapsed, STALL_TIMEOUT + 2, error)
        ray.kill(broken.workers[0])
        self._survivors_sync(harness, manager, healthy, broken)

    def test_slow_receiver_past_the_timeout_is_blamed(self, harness: SyncHarness) -> None:
        manager, healthy, broken, error, elapsed = self._sync_with_a_broken_replica(
            harness, SyncTimeoutError, timeout=SLOW_TIMEOUT, delay_per_tensor=1.0
        )
        assert f"{self._broken_worker(healthy)} stopped making progress" in str(error)
        self._detected("slow receiver", elapsed, SLOW_TIMEOUT + 2, error)
        ray.kill(broken.workers[0])
        self._survivors_sync(harness, manager, healthy, broken)

    def test_receiver_that_dies_is_blamed_then_survivors_sync(
        self, harness: SyncHarness
    ) -> None:
        manager, healthy, broken, error, elapsed = self._sync_with_a_broken_replica(
            harness, SyncStageError, timeout=30, die_after=5
        )
        assert f"{self._broken_worker(healthy)} died" in str(error)
        self._detected("killed receiver", elapsed, 30 / 2, error)
        self._survivors_sync(harness, manager, healthy, broken)

    def test_sender_that_dies_is_blamed(self, harness: SyncHarness) -> None:
        harness.set_weights(seed=12)
        ray.get(harness.actors[0].set_weights.remote(
            12, harness.weights_profile, Faults(die_after=50)
        ))
        manager = harness.manager(sync_timeout_seconds=30)
        start = time.monotonic()
        try:
            with pytest.raises(SyncStageError) as info:
                manager.update_weights_sync(global_steps=12)
            elapsed = time.monotonic() - start
        finally:
            harness.replace_actor(0)
        assert info.value.worker == "actor_wg rank 0", str(info.value)
        assert "actor_wg rank 0 died" in str(info.value)
        self._detected("killed sender", elapsed, 30 / 2, info.value)
        self._recovers(harness)

    def test_corrupted_bucket_is_refused_and_blames_its_sender(
        self, harness: SyncHarness
    ) -> None:
        harness.set_weights(seed=13)
        manager = harness.manager(sync_timeout_seconds=self.failure_timeout_seconds)
        ray.get(harness.actors[0].corrupt_checksum.remote(0))
        start = time.monotonic()
        try:
            with pytest.raises(SyncStageError, match="is corrupt") as info:
                manager.update_weights_sync(global_steps=13)
        finally:
            ray.get(harness.actors[0].corrupt_checksum.remote(None))
        elapsed = time.monotonic() - start
        assert info.value.worker == "actor_wg rank 0", str(info.value)
        assert "actor_wg rank 0 sent data that failed verification" in str(info.value)
        self._detected("corrupted bucket", elapsed, self.failure_timeout_seconds, info.value)
        self._recovers(harness)

    # -- security and endurance ------------------------------------------------------------
    def test_outsider_can_neither_run_code_nor_join_and_syncs_stay_exact(
        self, harness: SyncHarness, tmp_path
    ) -> None:
        manager = harness.manager()
        harness.set_weights(seed=40)
        manager.update_weights_sync(global_steps=40)  # every engine listens now
        ports = sorted({port for ports in harness.engine_ports().values() for port in ports})
        assert ports, "the engines listen on no port: nothing to attack"
        marker = tmp_path / "outsider-ran-code"
        outsider = subprocess.Popen(
            [sys.executable, "-m", "weightsync_core.testing.outsider", "127.0.0.1",
             ",".join(map(str, ports)), str(marker), "120"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        try:
            if outsider.stdout is None:  # stdout=PIPE makes it a pipe: None is a bug
                raise RuntimeError("the outsider's stdout is not a pipe")
            # it has hit every port once; it goes on during and between the syncs
            assert outsider.stdout.readline().strip() == "ready"
            for step in (41, 42, 43):
                expected = harness.set_weights(seed=step)
                manager.update_weights_sync(global_steps=step)
                self.assert_delivered(harness, expected)
            # a whole round on the group kept between syncs
            assert outsider.stdout.readline().startswith("round"), "the outsider stopped"
        finally:
            outsider.send_signal(signal.SIGTERM)
            output, _ = outsider.communicate(timeout=60)
        report = json.loads(output.strip().splitlines()[-1])
        assert report["rounds"] >= 1
        assert not marker.exists(), "a payload from the outsider ran in an engine process"
        assert report["keys_found"] == [], report
        assert report["listed"] == [], f"a rendezvous store listed its keys: {report}"
        assert report["stores"] == [], f"a port served the outsider a store: {report}"

    flood_bounds: ClassVar[tuple[float, float, int]] = (3.0, 4.0, 64 << 20)
    """What a flood of junk at every port may cost: a sync at most ``factor`` times its
    calm time plus ``seconds``, each process at most ``bytes`` more resident memory. The
    4 s allow for another package's tests running beside these (``scripts/test-packages``
    runs two at once), whose load differs between the calm syncs and the flooded ones: with
    2 s, a flooded mooncake_sharded sync took 6.26 s against a bound of 5.74 s (1.25 s
    calm) in one of three such runs."""

    def test_flood_of_junk_at_every_port_costs_bounded_memory_and_time(
        self, harness: SyncHarness
    ) -> None:
        """An outsider floods every port the engines listen on with 60 MiB and tiny ZeroMQ
        frames and raw TCP junk while syncs run: each sync stays bit-exact and within the
        time bound, and no process grows past the memory bound."""
        factor, extra, memory = self.flood_bounds
        manager = harness.manager()
        processes = harness.workers()
        self.timed_sync(harness, manager, 50)  # every engine listens now, its buffers are allocated
        calm = statistics.median(self.timed_sync(harness, manager, step) for step in (51, 52, 53))
        before = ray.get([process.resources.remote() for process in processes])
        ports = sorted({port for ports in harness.engine_ports().values() for port in ports})
        flooder = subprocess.Popen(
            [sys.executable, "-m", "weightsync_core.testing.flood", "127.0.0.1",
             ",".join(map(str, ports)), "300"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        try:
            if flooder.stdout is None:  # stdout=PIPE makes it a pipe: None is a bug
                raise RuntimeError("the flooder's stdout is not a pipe")
            assert flooder.stdout.readline().strip() == "ready"
            time.sleep(1.0)  # the flood is in full swing
            flooded = [self.timed_sync(harness, manager, step) for step in (54, 55, 56)]
            after = ray.get([process.resources.remote() for process in processes])
        finally:
            flooder.send_signal(signal.SIGTERM)
            output, _ = flooder.communicate(timeout=60)
        sent = json.loads(output.strip().splitlines()[-1])
        growth = max(b["rss"] - a["rss"] for a, b in zip(before, after, strict=True))
        bound = factor * calm + extra
        print(f"\n[{self.backend}] flood of {len(ports)} ports ({sent}): syncs "
              f"{', '.join(f'{seconds:.2f}' for seconds in flooded)} s against {calm:.2f} s "
              f"calm (bound {bound:.2f} s); worst RSS growth {growth / 2**20:.1f} MiB")
        assert max(flooded) <= bound, f"a flooded sync took {max(flooded):.2f} s"
        assert growth <= memory, f"a process grew by {growth / 2**20:.0f} MiB under the flood"
        self._recovers(harness)

    def test_soak_keeps_resources_flat_and_close_frees_every_port(self) -> None:
        # a deployment of its own: waits of earlier failed syncs may still hold sockets of
        # the shared one (a gloo wait cannot be interrupted; it ends at the engine timeout).
        harness = self.make_harness()
        try:
            self._soak(harness)
        finally:
            harness.shutdown()

    def _soak(self, harness: SyncHarness) -> None:
        workers = harness.workers()
        ray.get([actor.set_uniform_weights.remote(256 << 10, 8) for actor in harness.actors])
        manager = harness.manager()
        manager.update_weights_sync(global_steps=0, allow_manifest_change=True)
        for step in range(1, 21):  # warm-up: buffers, connections, caches, staged copies
            manager.update_weights_sync(global_steps=step)
        syncs = by_profile(default=min(self.soak_syncs, DEFAULT_SOAK_SYNCS),
                           long=self.soak_syncs)
        bounds = dict(self.soak_bounds)
        if syncs < self.soak_syncs:  # memory: the long profile's bound per sync
            bounds["rss"] = max(bounds["rss"] * syncs / self.soak_syncs, SOAK_RSS_FLOOR)
        for window in range(1, SOAK_WINDOWS + 1):
            before = ray.get([worker.resources.remote() for worker in workers])
            start = time.monotonic()
            first = 21 + (window - 1) * syncs
            for step in range(first, first + syncs):
                manager.update_weights_sync(global_steps=step)
            seconds = time.monotonic() - start
            after = ray.get([worker.resources.remote() for worker in workers])
            growth = {key: max(b[key] - a[key] for a, b in zip(before, after, strict=True))
                      for key in self.soak_bounds}
            print(f"soak {self.backend}, window {window}: {syncs} syncs in {seconds:.1f}s, "
                  f"worst growth per process {growth} (bounds {bounds}), "
                  f"start {before[0]} / {before[-1]}")
            over = {key: growth[key] for key, bound in bounds.items() if growth[key] > bound}
            if not over:
                break
            assert window < SOAK_WINDOWS, f"{over} grew past {bounds} in each of " \
                f"{SOAK_WINDOWS} windows of {syncs} syncs: {growth}"
        ray.get([ref for worker in workers
                 for ref in [worker.execute_checkpoint_engine.remote("close")]])
        left = {pid: ports for pid, ports in harness.engine_ports().items() if ports}
        assert not left, f"listening after close: {left}"


class ControlFrameReplayTests(_ConformanceBase):
    """Cases for backends whose processes talk over weightsync's control channel (the ring
    backends, kimi): add it to the conformance class's bases."""

    replay_syncs: ClassVar[int] = 50
    """Syncs run while the outsider replays what it captured, in the long profile; the
    default profile runs at most :data:`DEFAULT_REPLAY_SYNCS` of them."""
    replayed_kinds: ClassVar[tuple[str, ...]] = ("credit", "bucket")
    """The messages the targeted outsider replays (the tags of the backend's messages)."""
    replay_rate: ClassVar[float] = 0.05
    """The share of those messages it replays (each once, at a random moment): a few per
    sync, so that an early replay seldom gives the sync away before a late one can do
    harm."""

    def test_replayed_credits_and_announcements_never_pass_as_success(
        self, harness: SyncHarness, tmp_path
    ) -> None:
        """An outsider without the key, who captured the sync's credits and bucket
        announcements, replays each one several times at random moments of the same sync, to
        where it went: every sync must either fail or deliver every tensor bit-exact."""
        self._sync_under_replays(harness, tmp_path, self.replay_rate,
                                 list(self.replayed_kinds))

    def test_every_replayed_control_frame_never_passes_as_success(
        self, harness: SyncHarness, tmp_path
    ) -> None:
        """The same, for every control frame of the sync (hellos and finals too), replayed
        to where it went and to other members."""
        self._sync_under_replays(harness, tmp_path, 3.0, [], syncs=5)

    def _sync_under_replays(self, harness: SyncHarness, tmp_path, rate: float,
                            kinds: list[str], syncs: int | None = None) -> None:
        members = harness.workers()
        ray.get([member.tap_control_frames.remote(str(tmp_path / f"{index}.tap"))
                 for index, member in enumerate(members)])
        workers = [worker for replica in harness.replicas for worker in replica.workers]
        # servers that read each bucket's tensors for a while: a slot stays in use long
        ray.get([worker.set_faults.remote(delay_per_tensor=0.002) for worker in workers])
        outsider = subprocess.Popen(
            [sys.executable, "-m", "weightsync_core.testing.replay", str(tmp_path), "600",
             "7", str(rate), *kinds], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        if syncs is None:
            syncs = by_profile(default=min(self.replay_syncs, DEFAULT_REPLAY_SYNCS),
                               long=self.replay_syncs)
        manager = harness.manager(sync_timeout_seconds=self.failure_timeout_seconds)
        silent: list[str] = []
        failures: list[str] = []
        try:
            if outsider.stdout is None:  # stdout=PIPE makes it a pipe: None is a bug
                raise RuntimeError("the outsider's stdout is not a pipe")
            assert outsider.stdout.readline().strip() == "ready"
            for attempt in range(syncs):
                expected = harness.set_weights(seed=300 + attempt, profile="buckets")
                try:
                    manager.update_weights_sync(global_steps=300 + attempt,
                                                allow_manifest_change=True)
                except SyncStageError as exc:
                    failures.append(f"sync {attempt}: {exc}"[:300])
                    continue
                try:
                    self.assert_delivered(harness, expected)
                except AssertionError as exc:
                    silent.append(f"sync {attempt}: {exc}")
        finally:
            outsider.send_signal(signal.SIGTERM)
            output, _ = outsider.communicate(timeout=60)
            ray.get([member.tap_control_frames.remote(None) for member in members])
            ray.get([worker.set_faults.remote() for worker in workers])
        report = json.loads(output.strip().splitlines()[-1])
        print(f"\n[{self.backend}] replays of {kinds or 'every frame'}: {report['captured']} "
              f"frames captured, {report['sent']} replayed over {syncs} syncs; "
              f"{len(failures)} failed, {len(silent)} succeeded with wrong weights")
        assert report["captured"] and report["sent"], report
        print("\n".join(failures[:3]))
        assert not silent, f"syncs reported success with wrong weights: {silent[:3]}"
        self._restore_standard_layout(harness, manager)


class ColocatedEngineConformanceTests(_ConformanceBase):
    """Conformance for colocated engines (actor and rollout share each process)."""

    actor_world_size: ClassVar[int] = 2
