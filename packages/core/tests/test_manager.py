"""CheckpointEngineManager behaviour that needs no running transfer."""

import asyncio
import inspect
from typing import ClassVar

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
from weightsync_core.orchestration import manager as manager_module


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

    async def abort_all_requests(self, reject_request=False):
        self.calls.append("abort_all_requests" + (" (reject)" if reject_request else ""))
        if self.fail_abort:
            raise RuntimeError("server unreachable")

    async def release_kv_cache(self):
        self.calls.append("release_kv_cache")

    async def resume_kv_cache(self):
        self.calls.append("resume_kv_cache")

    async def resume_generation(self):
        self.calls.append("resume_generation")

    async def sleep(self, **options):
        self.calls.append(("sleep", options))


def test_failure_before_transfer_resumes_replicas_but_never_stale_ones():
    stale, failing = LifecycleReplica(), LifecycleReplica(fail_abort=True)
    manager = CheckpointEngineManager(
        CheckpointEngineConfig(backend="gloo"), RayWorkerGroup([]), [stale, failing]
    )
    manager.stale_replicas = [stale]  # left with incomplete weights by an earlier failure
    with pytest.raises(SyncStageError, match="stage 'abort_requests' on replica 1") as info:
        manager.update_weights_sync(global_steps=1)
    assert info.value.stage == "abort_requests"
    assert failing.calls[-2:] == ["resume_kv_cache", "resume_generation"]
    assert "resume_generation" not in stale.calls
    assert manager.stale_replicas == [stale]


def test_update_weights_runs_when_called_from_synchronous_code():
    # verl's trainer calls checkpoint_manager.update_weights(global_steps) without await: it
    # must run the sync (here: fail for want of replicas), never return a dropped coroutine
    manager = CheckpointEngineManager(CheckpointEngineConfig(backend="gloo"), RayWorkerGroup([]))
    with pytest.raises(SyncStageError, match="add_replicas"):
        manager.update_weights(3)


def test_update_weights_is_awaitable_from_async_code_and_from_helpers_it_calls():
    manager = CheckpointEngineManager(CheckpointEngineConfig(backend="gloo"), RayWorkerGroup([]))

    async def trainer_step():
        direct = manager.update_weights(4)
        helpers = [manager.update_weights(step) for step in (5, 6)]  # a comprehension's frame
        assert all(inspect.iscoroutine(call) for call in [direct, *helpers])
        return await asyncio.gather(direct, *helpers, return_exceptions=True)

    errors = asyncio.run(trainer_step())
    assert all(isinstance(error, SyncStageError) for error in errors)


def test_update_weights_from_a_synchronous_function_inside_a_running_loop_runs_it():
    manager = CheckpointEngineManager(CheckpointEngineConfig(backend="gloo"), RayWorkerGroup([]))

    def synchronous_callback():
        return manager.update_weights(7)

    async def main():
        with pytest.raises(SyncStageError, match="add_replicas"):
            synchronous_callback()

    asyncio.run(main())


def test_replica_lifecycle_methods_reach_every_replica_from_sync_and_async_code():
    first, second = LifecycleReplica(), LifecycleReplica()
    manager = CheckpointEngineManager(
        CheckpointEngineConfig(backend="gloo"), RayWorkerGroup([]), [first, second]
    )
    manager.release_kv_cache_replicas()
    manager.resume_kv_cache_replicas()
    manager.abort_replicas()
    manager.abort_replicas(reject_request=True)
    manager.resume_generation_replicas()

    async def asynchronous():
        await manager.sleep_replicas()

    asyncio.run(asynchronous())
    for replica in (first, second):
        assert replica.calls == ["release_kv_cache", "resume_kv_cache", "abort_all_requests",
                                 "abort_all_requests (reject)", "resume_generation",
                                 ("sleep", {})]


def test_replica_lifecycle_failures_name_the_replica_and_missing_methods_are_explained():
    manager = CheckpointEngineManager(
        CheckpointEngineConfig(backend="gloo"), RayWorkerGroup([]),
        [LifecycleReplica(), LifecycleReplica(fail_abort=True)],
    )
    with pytest.raises(SyncStageError, match="stage 'abort_replicas' on replica 1"):
        manager.abort_replicas()
    with pytest.raises(TypeError, match=r"LifecycleReplica.*no wake_up"):
        manager.wake_up_replicas()


def test_a_colocated_sync_leaves_replicas_alone_as_verl_does():
    replica = LifecycleReplica()
    manager = CheckpointEngineManager(
        CheckpointEngineConfig(backend="naive"), RayWorkerGroup([]), [replica]
    )
    with pytest.raises(SyncStageError, match="moved no tensors"):
        manager.update_weights(8)
    assert replica.calls == []


class RecordingGroup:
    """A worker group without Ray: engine calls are coroutines that record themselves; the
    actor side moves ``moved`` on ``update_weights``, the rollout side fails to authenticate."""

    made: ClassVar[list] = []

    def __init__(self, workers, moved=None):
        self.workers = list(workers)
        self.moved = moved
        self.calls = []
        RecordingGroup.made.append(self)

    @property
    def world_size(self):
        return len(self.workers)

    def execute_checkpoint_engine(self, method, **per_rank_kwargs):
        self.calls.append(method)
        return [self._call(method) for _ in self.workers]

    async def _call(self, method):
        if method == "set_session_key" and self.moved is None:
            raise RuntimeError("rollout engine refused the key")

    def update_weights(self, global_steps=None, **options):
        return [self._transfer() for _ in self.workers]

    async def _transfer(self):
        return self.moved


class GroupedReplica(LifecycleReplica):
    """A replica that names its workers' group class."""

    worker_group_class = RecordingGroup

    def __init__(self, workers):
        super().__init__()
        self.workers = workers


def test_the_rollout_group_is_of_the_class_the_replicas_name():
    RecordingGroup.made.clear()
    actor = RecordingGroup(["actor"], moved={"num_tensors": 1})
    replicas = [GroupedReplica(["w0", "w1"]), GroupedReplica(["w2"])]
    manager = CheckpointEngineManager(CheckpointEngineConfig(backend="gloo"), actor, replicas)
    with pytest.raises(SyncStageError) as info:
        manager.update_weights_sync(global_steps=1)
    assert info.value.stage == "authenticate"
    assert info.value.worker == "rollout rank 0 (replica 0, worker 0)"
    rollout_groups = RecordingGroup.made[1:]
    assert [group.workers for group in rollout_groups] == [["w0", "w1", "w2"]] * 2
    assert rollout_groups[1].calls == ["abort"]  # the recovery aborts the same workers
    assert replicas[0].calls[-2:] == ["resume_kv_cache", "resume_generation"]
    assert manager.stale_replicas == []


def test_replicas_of_different_group_classes_are_refused():
    manager = CheckpointEngineManager(
        CheckpointEngineConfig(backend="gloo"), RayWorkerGroup([]), [LifecycleReplica()]
    )
    with pytest.raises(ValueError, match=r"group class RecordingGroup, the managed replicas "
                                         r"RayWorkerGroup"):
        manager.add_replicas([GroupedReplica([])])
    assert type(manager.rollout_group(["w"])) is RayWorkerGroup


def test_a_sync_reports_every_stage_time_and_what_it_moved():
    moved = {"nbytes": 4_000_000, "num_tensors": 3, "num_buckets": 2}
    manager = CheckpointEngineManager(
        CheckpointEngineConfig(backend="naive"), RecordingGroup(["a0", "a1"], moved=moved),
        [LifecycleReplica()],
    )
    metrics = manager.update_weights_sync(global_steps=2)
    assert set(metrics) == {
        *(f"weightsync/seconds/{stage}" for stage in (
            "abort_requests", "release_kv_cache", "transfer", "resume_kv_cache",
            "resume_generation", "total",
        )),
        "weightsync/bytes", "weightsync/tensors", "weightsync/buckets", "weightsync/replicas",
        "weightsync/transfer_gbps", "weightsync/gbps", "weightsync/staged",
    }
    assert metrics["weightsync/staged"] == 0.0  # naive hands over in-process: no stage
    assert (metrics["weightsync/bytes"], metrics["weightsync/tensors"],
            metrics["weightsync/buckets"], metrics["weightsync/replicas"]) == (4e6, 3, 2, 1)


def test_an_error_from_synchronous_code_is_raised_as_it_is():
    # called from synchronous code, the sync's own error comes first in the trace: it is not
    # chained to the "no running event loop" that tells sync callers from async ones
    manager = CheckpointEngineManager(CheckpointEngineConfig(backend="gloo"), RayWorkerGroup([]))
    with pytest.raises(SyncStageError, match="add_replicas") as info:
        manager.update_weights(4)
    assert info.value.__context__ is None


class _NoSuchMethodGroup(RecordingGroup):
    """A group whose workers lack the engine methods (as verl's colocated workers, whose
    methods carry a role prefix): every engine call fails before it starts."""

    def execute_checkpoint_engine(self, method, **per_rank_kwargs):
        raise AttributeError(f"'ActorHandle' object has no attribute '{method}'")


def test_a_group_that_cannot_even_abort_leaves_the_real_error_and_resumed_replicas():
    replica = LifecycleReplica()
    replica.workers = ["w0"]
    manager = CheckpointEngineManager(
        CheckpointEngineConfig(backend="gloo"), _NoSuchMethodGroup(["a0"]), [replica]
    )
    with pytest.raises(SyncStageError, match="has no attribute 'set_session_key'") as info:
        manager.update_weights_sync(global_steps=1)
    assert info.value.stage == "authenticate"
    assert replica.calls[-2:] == ["resume_kv_cache", "resume_generation"]
    assert manager.stale_replicas == []


class _Remote:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def remote(self, *args, **kwargs):
        self.calls.append((self.name, args, kwargs))
        return self.name


class _PrefixedHandle:
    """A Ray handle's shape with a role's methods under prefixed names."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if not name.startswith("actor_rollout_"):
            raise AttributeError(name)
        return _Remote(name, self.__dict__["calls"])


def test_a_ray_worker_group_calls_methods_under_their_role_prefix():
    handle = _PrefixedHandle()
    group = RayWorkerGroup([handle], method_prefix="actor_rollout_")
    assert group.execute_checkpoint_engine("prepare") == ["actor_rollout_execute_checkpoint_engine"]
    assert group.update_weights(3) == ["actor_rollout_update_weights"]
    assert handle.calls == [("actor_rollout_execute_checkpoint_engine", ("prepare",), {}),
                            ("actor_rollout_update_weights", (3, False), {})]
    with pytest.raises(AttributeError):
        RayWorkerGroup([handle]).update_weights(3)
