"""The staged syncs' failure matrix with a generating client (real Ray actors, real gloo,
real HF generation, two replicas of one process each): a killed sender, a killed receiver, a
corrupted bucket, a refused tensor and a timeout, in phase 1 (staging) and in phase 2 (the
switch). In every case the client on a replica whose process is alive gets no error and no
response from a version that was not whole; that replica serves its old version (phase 1)
or the version it was rolled back to (phase 2), a token arrives within 1 s of the failure,
its tokens are Hugging Face's on the version it reports, and the next sync is bit-exact."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import ray
import torch
from trainer_test_helpers import hf_sampled_tokens
from trainer_test_plugins.staging_faults import FaultyPolicySource, FaultyRolloutWorker

from weightsync_core import (
    CheckpointEngineConfig,
    CheckpointEngineManager,
    RayRolloutReplica,
    RayWorkerGroup,
    SyncStageError,
)
from weightsync_trainer.bench_stall import MODELS

MODEL = MODELS["tiny"]
PROMPT = torch.randint(0, MODEL.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
CONFIG = CheckpointEngineConfig(backend="gloo", rollout_dtype="bfloat16",
                                update_weights_bucket_megabytes=1, sync_timeout_seconds=20)


@dataclass
class Deployment:
    """A policy source and two one-process HF replicas; ``states[v]`` is the source's
    weights at version ``v``, ``version`` the latest version synced whole."""

    source: Any
    workers: list[Any]
    version: int = 0
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def replicas(self) -> list[RayRolloutReplica]:
        return [RayRolloutReplica([worker], name=f"replica-{index}")
                for index, worker in enumerate(self.workers)]

    def manager(self, timeout: float = CONFIG.sync_timeout_seconds) -> CheckpointEngineManager:
        return CheckpointEngineManager(replace(CONFIG, sync_timeout_seconds=timeout),
                                       RayWorkerGroup([self.source]), self.replicas())

    def sync_whole(self) -> None:
        """The next sync, after a failure: every replica bit-exact with the source."""
        self.step()
        metrics = self.manager().update_weights_sync(global_steps=self.version)
        assert metrics["weightsync/staged"] == 1.0
        checksum = ray.get(self.source.checksum.remote())
        assert ray.get([w.weights_checksum.remote() for w in self.workers]) == [checksum] * 2

    def step(self) -> int:
        """A new version on the source; returns it."""
        self.version += 1
        ray.get(self.source.step.remote(self.version, 1.0))
        self.states[self.version] = ray.get(self.source.state_dict.remote())
        return self.version

    def replace_source(self) -> None:
        ray.kill(self.source)
        self.source = _source()
        ray.get(self.source.step.remote(self.version, 1.0))  # any weights: the next sync
        # is a whole one

    def replace_worker(self, index: int) -> None:
        ray.kill(self.workers[index])
        self.workers[index] = _worker()


def _source() -> Any:
    return ray.remote(FaultyPolicySource).remote(CONFIG, MODEL)


def _worker() -> Any:
    return ray.remote(FaultyRolloutWorker).remote(CONFIG, MODEL, 1.0, 1)


@pytest.fixture(scope="module")
def deployment():
    served = Deployment(_source(), [_worker(), _worker()])
    served.states[0] = ray.get(served.source.state_dict.remote())
    served.manager().update_weights_sync(global_steps=0)
    yield served
    for handle in (served.source, *served.workers):
        ray.kill(handle)


@dataclass(frozen=True)
class Case:
    """A fault: who gets it (``"source"`` or a replica's index), what is set, in which
    phase; ``stage`` is the failed sync's stage (None: the sync succeeds); ``timeout`` the
    manager's (the timeout cases: a stalled stage or switch fails after 3 s)."""

    fault: str
    target: str | int
    phase: int
    stage: str | None
    timeout: float = CONFIG.sync_timeout_seconds


CASES = {
    "killed sender, phase 1": Case("die_after_tensors", "source", 1, "transfer"),
    "corrupted bucket, phase 1": Case("corrupt_bucket", "source", 1, "transfer"),
    "refused tensor, phase 1": Case("refuse_stage", 0, 1, "transfer"),
    "timeout, phase 1": Case("stall_stage", 0, 1, "transfer", 3),
    "killed receiver, phase 1": Case("die_in_stage", 1, 1, "transfer"),
    "killed sender, phase 2": Case("kill", "source", 2, None),
    "refused switch, phase 2": Case("refuse_switch", 0, 2, "commit"),
    "timeout, phase 2": Case("stall_in_pause", 0, 2, "commit", 3),
    "killed receiver, phase 2": Case("die_in_switch", 1, 2, "commit"),
}


def _inject(served: Deployment, case: Case) -> None:
    if case.fault == "die_after_tensors":
        ray.get(served.source.die_after_tensors.remote(3))
    elif case.fault == "corrupt_bucket":
        ray.get(served.source.corrupt_bucket.remote(0))
    elif case.fault == "kill":
        ray.kill(served.source)  # after its stage arrived whole
    else:
        assert isinstance(case.target, int)
        ray.get(served.workers[case.target].set_fault.remote(case.fault, 3))


async def _generating_while(worker: Any, syncs) -> list[dict[str, Any]]:
    """Keep ``worker`` generating, one request after another, while ``syncs()`` runs; a
    request that fails fails the test."""
    samples: list[dict[str, Any]] = []
    done = asyncio.Event()

    async def client() -> None:
        seed = 0
        while not done.is_set():
            samples.append(await worker.generate_sample.remote(PROMPT, 6, seed))
            seed += 1

    task = asyncio.ensure_future(client())
    try:
        await syncs()
        await asyncio.sleep(1.0)  # the client is served after the failure too
    finally:
        done.set()
        await task
    return samples


@pytest.mark.parametrize("name", list(CASES))
def test_a_failed_staged_sync_leaves_the_client_served_on_a_whole_version(deployment, name):
    case, served = CASES[name], deployment
    old = served.version
    new = served.step()
    manager = served.manager(case.timeout)
    errors: list[SyncStageError] = []
    failed_at: list[float] = []

    async def failing_sync() -> None:
        await asyncio.sleep(0.1)
        try:
            if case.phase == 1:
                _inject(served, case)
                await manager.update_weights(global_steps=new)
            else:
                await manager.stage_weights(global_steps=new)
                _inject(served, case)
                await manager.commit_weights()
        except SyncStageError as error:
            errors.append(error)
        failed_at.append(time.monotonic())

    samples = asyncio.run(_generating_while(served.workers[0], failing_sync))

    if case.stage is None:
        assert not errors, errors
    else:
        assert errors and errors[0].stage == case.stage, (errors, case)
    # replica 0's process is alive: it served every request, each on one whole version, and
    # the version it ends on is its old one unless it took the update whole
    expected = new if case.fault in ("kill", "die_in_switch") else old
    assert samples, "the client was not served"
    for sample in samples:
        assert sample["versions"] == sorted(sample["versions"]), sample["versions"]
        assert set(sample["versions"]) <= {old, new}, sample["versions"]
    if expected == old:
        assert all(set(sample["versions"]) == {old} for sample in samples)
    times = [t for sample in samples for t in sample["token_times"]]
    assert any(failed_at[0] <= t <= failed_at[0] + 1.0 for t in times), (
        "no token within 1 s of the failure")
    status = manager.weights_status_sync()["replica 0"]
    assert (status["state"], status["version"]) == ("serving", expected), status
    served_now = ray.get(served.workers[0].generate_sample.remote(PROMPT, 8, 4321))
    assert served_now["versions"] == [expected] * 8
    reference = hf_sampled_tokens(MODEL, served.states[expected], PROMPT, 4321, 8)
    assert torch.equal(served_now["tokens"], reference)

    if case.target == "source":
        if case.fault == "corrupt_bucket":
            ray.get(served.source.corrupt_bucket.remote(None))
        else:
            served.replace_source()
    elif case.fault.startswith("die"):
        served.replace_worker(1)
    served.sync_whole()


@pytest.fixture(scope="module")
def tensor_parallel(deployment):
    """A replica of two tensor-parallel HF workers, synced once (the module's source)."""
    workers = [ray.remote(FaultyRolloutWorker).remote(CONFIG, MODEL, 1.0, 1, (2, rank))
               for rank in range(2)]
    ray.get([worker.set_tensor_parallel_peers.remote([w for w in workers if w is not worker])
             for worker in workers])
    replica = RayRolloutReplica(workers, name="tp-replica")

    def manager(timeout: float = CONFIG.sync_timeout_seconds) -> CheckpointEngineManager:
        return CheckpointEngineManager(replace(CONFIG, sync_timeout_seconds=timeout),
                                       RayWorkerGroup([deployment.source]), [replica])

    deployment.step()
    manager().update_weights_sync(global_steps=deployment.version)
    yield workers, manager
    for worker in workers:
        ray.kill(worker)


@pytest.mark.parametrize(("fault", "timeout"), [("refuse_switch", 20), ("stall_in_pause", 3)])
def test_a_tensor_parallel_replica_whose_switch_fails_on_one_worker_serves_its_version(
        deployment, tensor_parallel, fault, timeout):
    """Phase 2 on a replica of two workers: one refuses its stage (the other took its own
    and is rolled back) or never pauses (nothing is committed); the replica is resumed on its
    version, the client gets no error, and the next sync is bit-exact."""
    workers, manager = tensor_parallel
    old = deployment.version
    deployment.step()
    ray.get(workers[1].set_fault.remote(fault))
    errors: list[SyncStageError] = []

    async def failing_sync() -> None:
        await asyncio.sleep(0.1)
        try:
            await manager(timeout).update_weights(global_steps=deployment.version)
        except SyncStageError as error:
            errors.append(error)

    samples = asyncio.run(_generating_while(workers[0], failing_sync))
    assert errors and errors[0].stage == "commit", errors
    assert "rolled back to the version they served, and serving: ['replica 0']" in str(
        errors[0])
    assert samples and all(set(sample["versions"]) == {old} for sample in samples)
    status = manager().weights_status_sync()["replica 0"]
    assert (status["state"], status["version"]) == ("serving", old), status
    served = ray.get(workers[0].generate_sample.remote(PROMPT, 8, 4321))
    reference = hf_sampled_tokens(MODEL, deployment.states[old], PROMPT, 4321, 8)
    assert torch.equal(served["tokens"], reference)
    deployment.step()
    manager().update_weights_sync(global_steps=deployment.version)
    checksum = ray.get(deployment.source.checksum.remote())
    assert ray.get([worker.weights_checksum.remote() for worker in workers]) == [checksum] * 2
