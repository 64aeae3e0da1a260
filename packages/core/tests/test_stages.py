"""SyncStages: stages under one deadline, timed, failures and timeouts naming whom to blame."""

import asyncio
import inspect

import pytest
import ray.exceptions

from weightsync_core import SyncStageError, SyncTimeoutError
from weightsync_core.orchestration import stages as stages_module
from weightsync_core.orchestration.stages import SyncStages


async def _value(value, delay=0.0):
    await asyncio.sleep(delay)
    return value


async def _fail(message, delay=0.0):
    await asyncio.sleep(delay)
    raise RuntimeError(message)


def test_stages_return_results_in_order_and_record_each_stage_time():
    async def main():
        stages = SyncStages("gloo", timeout_seconds=5)
        first = await stages.run("prepare", lambda: [("a", _value(1, 0.02)), ("b", _value(2))])
        second = await stages.run("finalize", lambda: [])
        return stages, first, second

    stages, first, second = asyncio.run(main())
    assert (first, second) == ([1, 2], [])
    assert set(stages.metrics) == {"weightsync/seconds/prepare", "weightsync/seconds/finalize"}
    assert stages.metrics["weightsync/seconds/prepare"] >= 0.02
    assert stages.elapsed() >= sum(stages.metrics.values())
    assert stages.current == "finalize"


def test_a_failing_call_names_stage_process_and_host_and_lists_the_others():
    async def main():
        hosts = {}
        stages = SyncStages("gloo", timeout_seconds=5, hosts=hosts)
        hosts["rank 1"] = "10.0.0.2"  # learnt during the sync, read when the stage fails
        await stages.run("transfer", lambda: [
            ("rank 0", _value(0)), ("rank 1", _fail("disk full")), ("rank 2", _fail("echo", 0.05)),
        ])

    with pytest.raises(SyncStageError) as info:
        asyncio.run(main())
    error = info.value
    assert not isinstance(error, SyncTimeoutError)
    assert (error.stage, error.worker, error.host) == ("transfer", "rank 1", "10.0.0.2")
    assert str(error) == (
        "weight sync (gloo) failed at stage 'transfer' on rank 1: RuntimeError: disk full. "
        "Also failed: rank 2: RuntimeError: echo. rank 1 runs on host 10.0.0.2"
    )


def test_a_stage_past_the_deadline_times_out_naming_the_pending_and_the_stalled():
    async def main():
        stages = SyncStages("gloo", timeout_seconds=0.1)
        await stages.run("init_process_group", lambda: [
            ("rank 0", _value(0)), ("rank 1", _value(1, 30)),
        ], probe=lambda: [("rank 1", _value(None, 30))])  # rank 1 never answers

    with pytest.raises(SyncTimeoutError) as info:
        asyncio.run(main())
    error = info.value
    assert (error.stage, error.pending, error.worker) == (
        "init_process_group", ["rank 1"], "rank 1"
    )
    assert str(error).startswith(
        "weight sync (gloo) timed out at stage 'init_process_group' after 0s "
        "(sync_timeout_seconds): rank 1 stopped responding"
    )
    assert str(error).endswith("still waiting on: rank 1")


def test_min_seconds_lets_a_closing_stage_outlive_the_deadline():
    async def main():
        stages = SyncStages("gloo", timeout_seconds=0.01)
        await asyncio.sleep(0.02)  # the deadline has passed
        return await stages.run("resume_generation", lambda: [("replica 0", _value("ok", 0.05))],
                                min_seconds=1.0)

    assert asyncio.run(main()) == ["ok"]


def test_driver_errors_become_the_current_or_a_named_stage_error():
    async def main():
        stages = SyncStages("gloo", timeout_seconds=5)
        await stages.run("prepare", lambda: [])
        return stages.error(ValueError("bad")), stages.error(KeyError("x"), "build_topology")

    current, named = asyncio.run(main())
    assert (current.stage, str(current)) == (
        "prepare", "weight sync (gloo) failed at stage 'prepare': ValueError: bad"
    )
    assert named.stage == "build_topology"
    assert str(named) == "weight sync (gloo) failed at stage 'build_topology': KeyError: 'x'"


def test_stages_never_block_on_ray_get():
    source = inspect.getsource(stages_module)
    assert "ray.get(" not in source
    assert "ray.wait(" not in source


async def _die(delay=0.0):
    await asyncio.sleep(delay)
    raise ray.exceptions.ActorDiedError()


def test_a_replica_call_that_died_blames_the_worker_that_died_not_the_replica():
    asked = []

    def members(name):
        asked.append(name)
        return {"replica 1": [("rollout rank 1 (replica 1, worker 0)", _value({})),
                              ("rollout rank 2 (replica 1, worker 1)", _die())]}.get(name, [])

    async def main():
        stages = SyncStages("gloo", timeout_seconds=5,
                            hosts={"rollout rank 2 (replica 1, worker 1)": "10.0.0.3"})
        await stages.run("abort_requests", lambda: [
            ("replica 0", _value(None)), ("replica 1", _die()),
        ], members=members)

    with pytest.raises(SyncStageError) as info:
        asyncio.run(main())
    error = info.value
    assert asked == ["replica 1"]
    assert (error.stage, error.worker, error.host) == (
        "abort_requests", "rollout rank 2 (replica 1, worker 1)", "10.0.0.3")
    assert str(error).startswith(
        "weight sync (gloo) failed at stage 'abort_requests' rollout rank 2 (replica 1, "
        "worker 1) died: ActorDiedError")


def test_a_replica_whose_workers_all_answer_keeps_the_blame_and_other_failures_ask_nobody():
    asked = []

    def members(name):
        asked.append(name)
        return [("rollout rank 0 (replica 0, worker 0)", _value({}))]

    async def main():
        stages = SyncStages("gloo", timeout_seconds=5)
        await stages.run("abort_requests", lambda: [
            ("replica 0", _die()), ("replica 1", _fail("server unreachable")),
        ], members=members)

    with pytest.raises(SyncStageError) as info:
        asyncio.run(main())
    assert asked == ["replica 0"]  # only a death is traced to a worker
    assert info.value.worker == "replica 0"
    assert "replica 0 died" in str(info.value)


def test_engine_names_of_peers_translate_through_the_round_s_peers():
    """In a round of some replicas, the engines' ``rollout rank 0`` is the manager's rank 2."""
    async def main():
        stages = SyncStages("gloo", timeout_seconds=0.1)
        stages.peers = {"actor rank 0": "actor_wg rank 0",
                        "rollout rank 0": "rollout rank 2 (replica 1, worker 0)"}
        waiting = [{"peer": "rollout rank 0", "what": "writing bucket 3", "seconds": 9.0}]
        await stages.run("transfer", lambda: [
            ("actor_wg rank 0", _value(0, 30)), ("rollout rank 2 (replica 1, worker 0)",
                                                 _value(0, 30)),
        ], probe=lambda: [
            ("actor_wg rank 0", _value({"state": "sending", "seconds": 9.0, "tensors": 0,
                                        "waiting": waiting})),
            ("rollout rank 2 (replica 1, worker 0)", _value(
                {"state": "receiving", "seconds": 9.0, "tensors": 0, "waiting": [
                    {"peer": "actor rank 0", "what": "reading bucket 3", "seconds": 9.0}]})),
        ])

    with pytest.raises(SyncTimeoutError) as info:
        asyncio.run(main())
    assert info.value.worker == "actor_wg rank 0"
    assert "it and rollout rank 2 (replica 1, worker 0) have waited on each other" in str(
        info.value)
