"""A staged sync through the manager, over real gloo groups between real Ray actors: phase 1
(``stage_weights``) moves and checks the update while every replica keeps serving, nothing
paused; phase 2 (``commit_weights``) pauses each replica for its own switch only. A failure
in phase 1 leaves every replica serving its version, not paused, not stale; a server that
fails to take its stage in phase 2 is rolled back to the version it served and resumed."""

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from weightsync_core import (
    CheckpointEngineConfig,
    CheckpointEngineManager,
    SyncStageError,
    WeightSyncError,
)
from weightsync_core.testing.harness import SyncHarness

PAUSE = "abort_all_requests"
RESUME = "resume_generation"


@pytest.fixture(scope="module")
def harness() -> Iterator[SyncHarness]:
    """One actor rank, a replica of one worker and one of two."""
    config = CheckpointEngineConfig(backend="gloo", update_weights_bucket_megabytes=1,
                                    sync_timeout_seconds=30)
    deployment = SyncHarness(config, actor_world_size=1, replica_sizes=(1, 2))
    try:
        yield deployment
    finally:
        deployment.shutdown()


def _lifecycles(harness: SyncHarness) -> list[list[str]]:
    return [list(report["lifecycle"]) for report in harness.reports()]


def _until(condition: Callable[[], bool], seconds: float = 60.0) -> None:
    """Wait until ``condition()`` holds (at most ``seconds``)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def _statuses(harness: SyncHarness) -> list[dict]:
    return ray.get([worker.weights_status.remote()
                    for replica in harness.replicas for worker in replica.workers])


def _delivered(harness: SyncHarness, expected: dict, step: int) -> None:
    for index, report in enumerate(harness.reports()):
        wrong = sorted(name for name in expected if report["received"].get(name) != expected[name])
        assert not wrong and set(report["received"]) == set(expected), (
            f"worker {index}: differing {wrong[:5]}")
        assert report["global_steps"][-1] == step


def _staged_sync(manager: CheckpointEngineManager, harness: SyncHarness, step: int) -> dict:
    expected = harness.set_weights(seed=step)
    manager.stage_weights_sync(global_steps=step)
    manager.commit_weights_sync()
    _delivered(harness, expected, step)
    return expected


def test_a_stage_pauses_nothing_and_the_commit_switches_every_replica(harness):
    manager = harness.manager()
    harness.set_weights(seed=1)
    manager.update_weights_sync(global_steps=1, allow_manifest_change=True)
    before = _lifecycles(harness)
    loads = [len(report["global_steps"]) for report in harness.reports()]
    expected = harness.set_weights(seed=2)
    manager.stage_weights_sync(global_steps=2)
    assert _lifecycles(harness) == before, "a stage paused a replica"
    assert [len(report["global_steps"]) for report in harness.reports()] == loads
    assert all(status["staged_version"] == 2 and status["version"] == 1
               for status in _statuses(harness))
    metrics = manager.commit_weights_sync()
    _delivered(harness, expected, 2)
    for was, now in zip(before, _lifecycles(harness), strict=True):
        assert now[len(was):] == [PAUSE, RESUME]
    assert metrics["weightsync/replicas_committed"] == 2
    assert 0 < metrics["weightsync/pause_seconds"] <= metrics["weightsync/seconds/commit"]
    assert all(status["version"] == 2 and status["staged_version"] is None
               for status in _statuses(harness))
    with pytest.raises(WeightSyncError, match="nothing is staged to commit"):
        manager.commit_weights_sync()


def test_a_corrupt_bucket_in_phase_one_leaves_every_replica_serving_its_version(harness):
    manager = harness.manager()
    expected = _staged_sync(manager, harness, 10)
    before = _lifecycles(harness)
    harness.set_weights(seed=11)
    ray.get(harness.actors[0].corrupt_checksum.remote(0))
    try:
        with pytest.raises(SyncStageError, match="Nothing was committed: every replica serves "
                           "the version it served") as info:
            manager.stage_weights_sync(global_steps=11)
    finally:
        ray.get(harness.actors[0].corrupt_checksum.remote(None))
    assert info.value.stage == "transfer"
    assert manager.stale_replicas == []
    assert _lifecycles(harness) == before, "a failed stage paused a replica"
    assert all(status["version"] == 10 and status["complete"]
               and status["staged_version"] is None for status in _statuses(harness))
    _delivered(harness, expected, 10)
    with pytest.raises(WeightSyncError, match="nothing is staged"):
        manager.commit_weights_sync()
    _staged_sync(manager, harness, 12)  # the next sync proceeds normally


def test_a_server_refusing_its_stage_is_rolled_back_and_resumed_on_its_version(harness):
    manager = harness.manager()
    previous = _staged_sync(manager, harness, 20)
    refusing = harness.replicas[1].workers[1]
    ray.get(refusing.set_faults.remote(refuse_after=2))
    expected = harness.set_weights(seed=21)
    manager.stage_weights_sync(global_steps=21)
    with pytest.raises(SyncStageError, match=r"failed at stage 'commit': rollout rank 2 "
                       r"\(replica 1, worker 1\): .*refused tensor.*rolled back to version "
                       r"20.*Took the update: \['replica 0'\]; rolled back to the version "
                       r"they served, and serving: \['replica 1'\]") as info:
        manager.commit_weights_sync()
    assert info.value.stage == "commit"
    assert manager.stale_replicas == []
    reports = harness.reports()
    assert reports[0]["received"] == expected
    # both workers of replica 1 back on version 20: the one that took 21 rolled back too
    assert reports[1]["received"] == reports[2]["received"] == previous
    statuses = _statuses(harness)
    assert [status["version"] for status in statuses] == [21, 20, 20]
    assert all(status["complete"] for status in statuses)
    assert _lifecycles(harness)[2][-2:] == [PAUSE, RESUME], "the rolled back replica serves"
    _staged_sync(manager, harness, 22)  # the next sync proceeds normally


def test_an_update_after_a_stage_drops_it_and_a_discarded_stage_is_gone(harness):
    manager = harness.manager()
    harness.set_weights(seed=30)
    manager.stage_weights_sync(global_steps=30)
    expected = harness.set_weights(seed=31)
    manager.update_weights_sync(global_steps=31)
    assert all(status["staged_version"] is None for status in _statuses(harness))
    with pytest.raises(WeightSyncError, match="nothing is staged"):
        manager.commit_weights_sync()
    _delivered(harness, expected, 31)
    harness.set_weights(seed=32)
    manager.stage_weights_sync(global_steps=32)
    manager.discard_staged_weights_sync()
    assert all(status["staged_version"] is None for status in _statuses(harness))
    _delivered(harness, expected, 31)


def test_staging_never_is_stop_the_world_and_refuses_a_stage_by_name(harness):
    manager = harness.manager(staging="never")
    assert not manager.stages_syncs()
    expected = harness.set_weights(seed=40)
    metrics = manager.update_weights_sync(global_steps=40)
    assert metrics["weightsync/staged"] == 0.0
    _delivered(harness, expected, 40)
    for lifecycle in _lifecycles(harness):
        assert lifecycle[-4:] == [PAUSE, "release_kv_cache", "resume_kv_cache", RESUME]
    with pytest.raises(TypeError, match=r"config\.staging is 'never'"):
        manager.stage_weights_sync(global_steps=41)
    assert harness.manager().stages_syncs()


def test_commit_each_switches_replicas_whose_stage_completed_and_together_none(harness):
    """A worker of replica 1 refuses its last staged tensor. ``commit="together"`` (the
    default) switches no replica; ``commit="each"`` switches replica 0, whose stage had
    completed, and leaves replica 1 serving its version, not paused."""
    together, each = harness.manager(), harness.manager(commit="each")
    previous = _staged_sync(together, harness, 50)
    refusing = harness.replicas[1].workers[1]
    for manager, step in ((together, 51), (each, 52)):
        before = _lifecycles(harness)
        expected = harness.set_weights(seed=step)
        # with "each", the refusal waits until replica 0 switched (its stage completed
        # first), which on a loaded machine the order of arrival alone does not ensure
        ray.get(refusing.set_faults.remote(refuse_stage_after=len(expected) - 1,
                                           hold_stage_refusal=manager is each))
        with ThreadPoolExecutor(1) as pool, pytest.raises(
                SyncStageError, match=r"refused staged tensor") as info:
            running = pool.submit(manager.update_weights_sync, global_steps=step)
            if manager is each:
                _until(lambda step=step, running=running: running.done()
                       or _statuses(harness)[0]["version"] == step)
                ray.get(refusing.release_stage_refusal.remote())
            running.result()
        assert info.value.stage == "transfer"
        assert manager.stale_replicas == []
        lifecycles = _lifecycles(harness)
        assert lifecycles[1:] == before[1:], "replica 1 was paused by a failed stage"
        statuses = _statuses(harness)
        assert all(status["complete"] and status["staged_version"] is None
                   for status in statuses)
        reports = harness.reports()
        assert reports[1]["received"] == reports[2]["received"] == previous
        if manager is together:
            assert "Nothing was committed" in str(info.value)
            assert [status["version"] for status in statuses] == [50, 50, 50]
            assert lifecycles[0] == before[0]
        else:
            assert ("Committed as their stages completed (commit='each'), before the "
                    "failure: took the update: ['replica 0']") in str(info.value)
            assert [status["version"] for status in statuses] == [step, 50, 50]
            assert reports[0]["received"] == expected
            assert lifecycles[0][len(before[0]):] == [PAUSE, RESUME]
    expected = harness.set_weights(seed=53)  # the next sync, each replica as it is ready
    metrics = each.update_weights_sync(global_steps=53)
    _delivered(harness, expected, 53)
    assert metrics["weightsync/staged"] == 1.0
    assert metrics["weightsync/replicas_committed"] == 2
    assert 0 <= metrics["weightsync/seconds/commit"] <= metrics["weightsync/seconds/total"]
