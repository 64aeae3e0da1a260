"""With real Ray actors: a sync refuses, before any byte moves, processes whose engines were
built with settings that change what travels other than its manager's config says; and a
process that died is named by its rollout rank, replica and worker in the manager's numbering
(not as its replica, nor as a round of a mixed delta sync numbers it)."""

from __future__ import annotations

import re
import time
from dataclasses import replace

import pytest
import ray
import ray.exceptions

from weightsync_core import CheckpointEngineConfig, RayRolloutReplica, SyncStageError
from weightsync_core.api.registry import CheckpointEngineRegistry
from weightsync_core.testing import SyncHarness
from weightsync_core.testing.actors import RecordingRolloutWorker

CONFIG = CheckpointEngineConfig(backend="gloo", update_weights_bucket_megabytes=1,
                                rollout_dtype="bfloat16", sync_timeout_seconds=30)
"""What the harness's processes are built with (one actor rank, one replica of one worker)."""

_BUILT_WITH_ANOTHER = "build every process's engine from the manager's config"


@pytest.fixture(scope="module")
def harness():
    harness = SyncHarness(CONFIG, actor_world_size=1, replica_sizes=(1,))
    yield harness
    harness.shutdown()


def _worker(config: CheckpointEngineConfig):
    return ray.remote(RecordingRolloutWorker).options(num_cpus=0).remote(config)


def _kill(worker) -> None:
    """Kill ``worker`` and wait until Ray reports it dead."""
    ray.kill(worker)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(worker.report.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the killed worker still answers")


def _lifecycle(harness: SyncHarness, replica) -> list[list[str]]:
    return [report["lifecycle"] for report in harness.reports([replica])]


# -- settings that change what travels ----------------------------------------------------


def test_travel_settings_fill_in_defaults_and_leave_the_bucket_to_engines_that_pack_buckets():
    from weightsync_core.api.config import TRAVEL_OPTIONS

    gloo = CheckpointEngineRegistry.get("gloo")
    sharded = CheckpointEngineRegistry.get("gloo_sharded")
    plain = CheckpointEngineConfig(backend="gloo").travel_settings(gloo)
    explicit = CheckpointEngineConfig(
        backend="gloo", engine_kwargs={"gloo": {"senders": 1, "host": "127.0.0.1",
                                                "group_init_timeout": 5.0}}
    ).travel_settings(gloo)
    assert plain == explicit  # a default said aloud, and options of one machine, agree
    assert plain == {
        "backend": "gloo", "rollout_dtype": None, "rollout_quantization": None, "verify": True,
        "update_weights_bucket_megabytes": 512,
        "engine_kwargs['gloo']['senders']": 1,
        "engine_kwargs['gloo']['multi_sender']": False,
        "engine_kwargs['gloo']['direct_send_megabytes']": None,
    }
    assert CheckpointEngineConfig(backend="gloo", rollout_dtype="torch.float16").travel_settings(
        gloo)["rollout_dtype"] == "float16"
    layouts = CheckpointEngineConfig(backend="gloo_sharded").travel_settings(sharded)
    assert "update_weights_bucket_megabytes" not in layouts  # pieces travel in chunks
    assert layouts["engine_kwargs['gloo_sharded']['chunk_megabytes']"] == 64.0
    assert layouts["engine_kwargs['gloo_sharded']['relay']"] is True
    assert set(TRAVEL_OPTIONS) >= {"senders", "chunk_megabytes", "relay", "slots"}


def test_a_worker_built_with_another_rollout_dtype_is_refused_before_any_byte_moves(harness):
    """The issue's case: fp32 would be served under a bf16 manager."""
    first = harness.replicas[0]
    odd = RayRolloutReplica([_worker(CONFIG), _worker(replace(CONFIG, rollout_dtype="float32"))],
                            name="odd")
    try:
        manager = harness.manager([first, odd])
        harness.set_weights(seed=3)
        with pytest.raises(SyncStageError) as info:
            manager.update_weights_sync(global_steps=3)
        error = info.value
        assert (error.stage, error.worker) == ("prepare", "rollout rank 2 (replica 1, worker 1)")
        assert ("failed at stage 'prepare': rollout rank 2 (replica 1, worker 1) was built with "
                "rollout_dtype='float32' but this manager's config says 'bfloat16': "
                f"{_BUILT_WITH_ANOTHER}") in str(error), str(error)
        # nothing moved, no replica is left stale, every replica serves again
        assert manager.stale_replicas == []
        for report in harness.reports([first, odd]):  # none left paused
            assert 3 not in report["global_steps"]
            assert report["lifecycle"][-1:] in ([], ["resume_generation"]), report["lifecycle"]
    finally:
        for worker in odd.workers:
            ray.kill(worker)


def test_a_manager_whose_settings_differ_from_every_process_is_refused_naming_each(harness):
    harness.set_weights(seed=4)
    with pytest.raises(SyncStageError) as info:
        harness.manager(rollout_dtype="float32", verify=False).update_weights_sync(
            global_steps=4)
    assert (info.value.stage, info.value.worker) == ("prepare", "actor_wg rank 0")
    assert ("actor_wg rank 0 was built with rollout_dtype='bfloat16', verify=True but this "
            "manager's config says rollout_dtype='float32', verify=False: "
            f"{_BUILT_WITH_ANOTHER} (1 other process(es) differ as well: rollout rank 0 "
            "(replica 0, worker 0))") in str(info.value), str(info.value)

    options = {"gloo": {"direct_send_megabytes": 4.0}}
    with pytest.raises(SyncStageError, match=re.escape(
            "was built with engine_kwargs['gloo']['direct_send_megabytes']=None but this "
            "manager's config says 4.0")):
        harness.manager(engine_kwargs=options).update_weights_sync(global_steps=4)

    with pytest.raises(SyncStageError, match=re.escape(
            "was built with update_weights_bucket_megabytes=1 but this manager's config says 2")):
        harness.manager(update_weights_bucket_megabytes=2).update_weights_sync(global_steps=4)

    # what only the manager reads may differ: its deadline, and delta (it hands each sync's
    # plan to every process)
    expected = harness.set_weights(seed=5)
    harness.manager(sync_timeout_seconds=20, delta=True).update_weights_sync(global_steps=5)
    assert all(report["received"] == expected for report in harness.reports())


# -- errors name the process, in the manager's numbering -----------------------------------


def test_a_worker_killed_between_syncs_is_named_not_its_replica(harness):
    first = harness.replicas[0]
    victim = harness.new_replica(2, name="victim")
    manager = harness.manager([first, victim])
    try:
        _kill(victim.workers[1])
        harness.set_weights(seed=6)
        with pytest.raises(SyncStageError) as info:
            manager.update_weights_sync(global_steps=6)
        error = info.value
        # its first call: the pause of a stop-the-world sync, the key of a staged one
        first_stage = "authenticate" if manager.stages_syncs() else "abort_requests"
        assert (error.stage, error.worker) == (first_stage,
                                               "rollout rank 2 (replica 1, worker 1)")
        assert "rollout rank 2 (replica 1, worker 1) died: " in str(error), str(error)
        assert "replica 1 died" not in str(error)
        # the same outside a sync
        with pytest.raises(SyncStageError) as info:
            manager.abort_replicas()
        assert (info.value.stage, info.value.worker) == (
            "abort_replicas", "rollout rank 2 (replica 1, worker 1)")
    finally:
        for worker in victim.workers:
            ray.kill(worker)


def test_a_worker_dying_in_the_second_round_of_a_mixed_delta_sync_has_the_managers_number(
        harness):
    """Patches go to the first replica, whole tensors to the newcomer (replica 1 of the
    manager, rollout rank 1), in a round of its own where it is replica 0, rollout rank 0."""
    first = harness.replicas[0]
    manager = harness.manager([first], delta=True)
    harness.set_weights(seed=7)
    manager.update_weights_sync(global_steps=7)
    newcomer = harness.new_replica(1, name="newcomer")
    try:
        ray.get(newcomer.workers[0].set_faults.remote(die_after=1))
        manager.add_replicas([newcomer])
        harness.set_weights(seed=7, updates=[(8, 0.02)])
        with pytest.raises(SyncStageError) as info:
            manager.update_weights_sync(global_steps=8)
        error = info.value
        assert (error.stage, error.worker) == ("transfer", "rollout rank 1 (replica 1, worker 0)")
        assert "rollout rank 1 (replica 1, worker 0) died" in str(error), str(error)
        assert "(replica 0, worker 0)" not in str(error)
        assert "in the round of whole tensors to replica(s) [1] of this manager" in str(error)
        assert _lifecycle(harness, first)[0][-1] == "resume_generation"
    finally:
        manager.remove_replicas([newcomer])
        for worker in newcomer.workers:
            ray.kill(worker)


# -- a sync of the same processes begins in one call per process ----------------------------


def test_a_sync_of_known_processes_begins_in_one_call_and_a_failure_names_its_stage(harness):
    """The first sync learns that every process is weightsync's own (it answers
    BUILT_SETTINGS): later ones hand the key, learn the host and the settings and prepare
    in one call per process (stage ``prepare``), and a process that fails in it is blamed
    at the stage of the step that failed."""
    manager = harness.manager()
    actor, worker = harness.actors[0], harness.replicas[0].workers[0]
    stages = {"authenticate", "locate", "prepare"}

    def timed(step: int) -> set[str]:
        expected = harness.set_weights(seed=step)
        metrics = manager.update_weights_sync(global_steps=step)
        assert harness.reports()[0]["received"] == expected
        return {key.removeprefix("weightsync/seconds/") for key in metrics
                if key.removeprefix("weightsync/seconds/") in stages}

    assert timed(10) == stages  # nothing known yet: three stages
    assert timed(11) == {"prepare"}  # one call
    for process, name in ((worker, "rollout rank 0 (replica 0, worker 0)"),
                          (actor, "actor_wg rank 0")):
        for method, stage in (("set_session_key", "authenticate"), ("address", "locate"),
                              ("prepare", "prepare")):
            ray.get(process.fail_engine_call.remote(method))
            harness.set_weights(seed=12)
            with pytest.raises(SyncStageError) as info:
                manager.update_weights_sync(global_steps=12)
            assert (info.value.stage, info.value.worker) == (stage, name), str(info.value)
            assert f"failed at stage '{stage}'" in str(info.value)
            assert f"{method} failed on purpose" in str(info.value)
            ray.get(process.fail_engine_call.remote(None))
    assert manager.stale_replicas == []
    assert timed(13) == {"prepare"}  # the failures changed nothing: still one call
