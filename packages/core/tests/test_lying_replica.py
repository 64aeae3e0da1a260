"""A process whose engine's prepare() returns wrong metadata (a replica that lies) is named
by the sync's error, before any byte moves, and its replicas are resumed, not left stale."""

import time

import pytest
import ray

from weightsync_core import CheckpointEngineConfig, CheckpointEngineManager, SyncStageError
from weightsync_core.api.registry import CheckpointEngineRegistry
from weightsync_core.engines import RingCheckpointEngine
from weightsync_core.testing import SyncHarness
from weightsync_core.verl_compat import CheckpointEngine as VerlCheckpointEngine


class _MetadataGroup:
    """A worker group without Ray whose workers' ``prepare()`` return ``metadata`` (one entry
    per worker); every other engine call succeeds, and every call is recorded."""

    def __init__(self, metadata):
        self.metadata = list(metadata)
        self.workers = [f"w{index}" for index in range(len(self.metadata))]
        self.calls = []

    @property
    def world_size(self):
        return len(self.workers)

    def execute_checkpoint_engine(self, method, **per_rank_kwargs):
        self.calls.append(method)
        return [self._answer(method, entry) for entry in self.metadata]

    async def _answer(self, method, entry):
        return {"prepare": entry, "address": "127.0.0.1"}.get(method)

    def update_weights(self, global_steps=None, **options):
        raise AssertionError("no byte may move after a process lied in prepare()")


class _Replica:
    """A replica over some of the rollout workers, recording its lifecycle calls."""

    worker_group_class = None

    def __init__(self, workers):
        self.workers = workers
        self.calls = []

    async def _record(self, name):
        self.calls.append(name)

    def __getattr__(self, name):
        if name in ("abort_all_requests", "release_kv_cache", "resume_kv_cache",
                    "resume_generation"):
            return lambda: self._record(name)
        raise AttributeError(name)


def _register(name, engine_class):
    if name not in CheckpointEngineRegistry.names():
        CheckpointEngineRegistry.register(name)(engine_class)


class _Ring(RingCheckpointEngine):
    """A ring engine, for its topology (no process here ever starts it)."""

    def create_transport(self):
        raise NotImplementedError


class _VerlStyle(VerlCheckpointEngine):
    """An engine written for verl: its own builder reads every process's ``zmq_ip``."""

    def __init__(self, bucket_size, **kwargs):
        self.bucket_size = bucket_size

    def prepare(self):
        return {"zmq_ip": "127.0.0.1"}

    @classmethod
    def build_topology(cls, actor_wg_world_size, rollout_world_size, metadata):
        addresses = [entry["zmq_ip"] for entry in metadata]
        return {"peers": [addresses] * actor_wg_world_size}, {
            "peers": [addresses] * rollout_world_size}

    def init_process_group(self, **kwargs):
        pass

    async def send_weights(self, weights, global_steps=None):
        pass

    async def receive_weights(self, global_steps=None):
        yield "never", None

    def finalize(self):
        pass


_register("test_lying_ring", _Ring)
_register("test_lying_verl_style", _VerlStyle)


def _sync_with(backend, actor_metadata, rollout_metadata, replica_sizes):
    """One sync through fake groups; returns the error, the replicas and the manager."""
    rollout = _MetadataGroup(rollout_metadata)
    workers = iter(rollout.workers)
    replicas = [_Replica([next(workers) for _ in range(size)]) for size in replica_sizes]
    manager = CheckpointEngineManager(
        CheckpointEngineConfig(backend=backend), _MetadataGroup(actor_metadata), replicas
    )
    manager.rollout_group = lambda _workers: rollout
    with pytest.raises(SyncStageError) as info:
        manager.update_weights_sync(global_steps=1)
    return info.value, replicas, manager


def test_a_ring_worker_without_its_endpoint_is_named_and_the_replicas_resume():
    endpoint = {"endpoint": "tcp://127.0.0.1:1"}
    error, replicas, manager = _sync_with(
        "test_lying_ring", [endpoint], [endpoint, {"address": "tcp://127.0.0.1:2"}], (2,))
    assert error.worker == "rollout rank 1 (replica 0, worker 1)"
    assert error.stage == "prepare"
    assert str(error) == (
        "weight sync (test_lying_ring) failed at stage 'prepare': rollout rank 1 (replica 0, "
        "worker 1) returned metadata without 'endpoint' (it holds 'address') from prepare(). "
        "rollout rank 1 (replica 0, worker 1) runs on host 127.0.0.1"
    )
    assert replicas[0].calls[-2:] == ["resume_kv_cache", "resume_generation"]
    assert manager.stale_replicas == []


def test_metadata_that_is_no_dict_is_named_with_what_it_was():
    endpoint = {"endpoint": "tcp://127.0.0.1:1"}
    error, _, _ = _sync_with("test_lying_ring", [endpoint, "whatever"], [endpoint], (1,))
    assert error.worker == "actor_wg rank 1"
    assert "actor_wg rank 1 returned metadata that is not a dict but str 'whatever'" in str(error)


def test_an_engine_s_own_builder_failing_on_one_process_s_metadata_blames_that_process():
    good = {"zmq_ip": "127.0.0.1"}
    error, replicas, _ = _sync_with(
        "test_lying_verl_style", [good], [good, good, {"zmq_port": 5}], (1, 2))
    assert error.worker == "rollout rank 2 (replica 1, worker 1)"
    assert ("rollout rank 2 (replica 1, worker 1) returned metadata without 'zmq_ip' from "
            "prepare() (build_topology failed on it: KeyError: 'zmq_ip')") in str(error)
    assert all(replica.calls[-1] == "resume_generation" for replica in replicas)
    # where every process returned the same, the builder is at fault: no process is blamed
    error, _, _ = _sync_with("test_lying_verl_style", [{}], [{}], (1,))
    assert error.worker is None and error.stage == "build_topology"


def test_lying_processes_of_a_real_sync_are_named_before_any_byte_moves():
    config = CheckpointEngineConfig(backend="gloo", update_weights_bucket_megabytes=1,
                                    sync_timeout_seconds=30)
    harness = SyncHarness(config, actor_world_size=1, replica_sizes=(2,))
    try:
        manager = harness.manager()
        [actor], [first, second] = harness.actors, harness.replicas[0].workers
        lies = [
            (second, {"drop": ["member"]}, "rollout rank 1 (replica 0, worker 1)",
             "returned metadata without 'member'"),
            (first, {"instead": "all is well"}, "rollout rank 0 (replica 0, worker 0)",
             "returned metadata that is not a dict but str 'all is well'"),
            (actor, {"drop": ["port"]}, "actor_wg rank 0", "returned metadata without 'port'"),
            # a port every rollout worker would have failed to reach, each blamed in turn
            (actor, {"update": {"port": "29500"}}, "actor_wg rank 0",
             "returned metadata whose 'port' is '29500', not a port number"),
        ]
        harness.set_weights(seed=61)
        for liar, lie, name, what in lies:
            ray.get(liar.lie_in_prepare.remote(**lie))
            start = time.monotonic()
            with pytest.raises(SyncStageError) as info:
                manager.update_weights_sync(global_steps=61)
            assert time.monotonic() - start < 15  # not the sync's timeout
            assert info.value.worker == name and info.value.stage == "prepare"
            assert f"{name} {what}" in str(info.value)
            assert manager.stale_replicas == []
            ray.get(liar.lie_in_prepare.remote())
        for report in harness.reports():  # none left paused (a staged sync paused none)
            assert report["lifecycle"][-1:] in ([], ["resume_generation"]), report["lifecycle"]
            assert report["global_steps"] == []  # nothing was loaded
        expected = harness.set_weights(seed=62)
        manager.update_weights_sync(global_steps=62)
        assert [report["received"] for report in harness.reports()] == [expected, expected]
    finally:
        harness.shutdown()
