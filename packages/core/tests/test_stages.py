"""SyncStages: stages under one deadline, timed, failures and timeouts naming whom to blame."""

import asyncio
import inspect

import pytest

from weightsync_core import SyncStageError, SyncTimeoutError
from weightsync_core import stages as stages_module
from weightsync_core.stages import SyncStages


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
