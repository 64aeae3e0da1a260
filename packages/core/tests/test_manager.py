"""CheckpointEngineManager behaviour that needs no running transfer."""

import asyncio
import inspect

import pytest

from weightsync_core import (
    BackendNotInstalledError,
    CheckpointEngineConfig,
    CheckpointEngineManager,
    RayRolloutReplica,
    RayWorkerGroup,
    SyncStageError,
    run_sync,
)
from weightsync_core import manager as manager_module


def test_missing_backend_fails_at_construction_with_install_hint():
    with pytest.raises(BackendNotInstalledError, match="weightsync-mooncake"):
        CheckpointEngineManager(CheckpointEngineConfig(backend="mooncake"), RayWorkerGroup([]))


def test_sync_without_replicas_explains_what_to_do():
    manager = CheckpointEngineManager(CheckpointEngineConfig(backend="gloo"), RayWorkerGroup([]))
    with pytest.raises(SyncStageError, match="add_replicas"):
        manager.update_weights_sync(global_steps=1)


def test_replica_membership_is_checked():
    replica = RayRolloutReplica([], name="r0")
    manager = CheckpointEngineManager(
        CheckpointEngineConfig(backend="gloo"), RayWorkerGroup([]), [replica]
    )
    with pytest.raises(ValueError, match="already managed"):
        manager.add_replicas([replica])
    manager.remove_replicas([replica])
    with pytest.raises(ValueError, match="not managed"):
        manager.remove_replicas([replica])


def test_run_sync_works_with_and_without_a_running_loop():
    async def answer():
        await asyncio.sleep(0)
        return 42

    assert run_sync(answer()) == 42

    async def inside_a_loop():
        return run_sync(answer())

    assert asyncio.run(inside_a_loop()) == 42


def test_manager_coroutines_never_block_on_ray_get():
    """The debt named in verl #6724: no blocking ray.get inside async manager methods."""
    source = inspect.getsource(manager_module)
    assert "ray.get(" not in source
    assert "ray.wait(" not in source


class LifecycleReplica:
    """A replica without workers that records lifecycle calls (and can fail to abort)."""

    def __init__(self, fail_abort=False):
        self.workers = []
        self.calls = []
        self.fail_abort = fail_abort

    async def abort_all_requests(self):
        self.calls.append("abort_all_requests")
        if self.fail_abort:
            raise RuntimeError("server unreachable")

    async def release_kv_cache(self):
        self.calls.append("release_kv_cache")

    async def resume_generation(self):
        self.calls.append("resume_generation")


def test_failure_before_transfer_resumes_replicas_but_never_stale_ones():
    stale, failing = LifecycleReplica(), LifecycleReplica(fail_abort=True)
    manager = CheckpointEngineManager(
        CheckpointEngineConfig(backend="gloo"), RayWorkerGroup([]), [stale, failing]
    )
    manager.stale_replicas = [stale]  # left with incomplete weights by an earlier failure
    with pytest.raises(SyncStageError, match="stage 'abort_requests' on replica 1") as info:
        manager.update_weights_sync(global_steps=1)
    assert info.value.stage == "abort_requests"
    assert "resume_generation" in failing.calls
    assert "resume_generation" not in stale.calls
    assert manager.stale_replicas == [stale]
