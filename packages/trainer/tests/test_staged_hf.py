"""Staged syncs into a Hugging Face replica that a client keeps generating on (real Ray
actors, real gloo, real HF generation): the client never gets an error nor a token of a
version that was not committed whole, a response's tokens never go back a version, a stage
refused in phase 1 leaves the replica serving its version, and what the replica serves
after the syncs samples exactly what Hugging Face samples on the actor's last weights."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray
import torch
from trainer_test_helpers import hf_sampled_tokens

from weightsync_core import (
    CheckpointEngineConfig,
    CheckpointEngineManager,
    RayRolloutReplica,
    RayWorkerGroup,
    SyncStageError,
)
from weightsync_trainer.bench_stall import MODELS, PolicySource
from weightsync_trainer.workers.rollout import RolloutWorker

MODEL = MODELS["tiny"]
PROMPT = torch.randint(0, MODEL.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
CONFIG = CheckpointEngineConfig(backend="gloo", rollout_dtype="bfloat16",
                                update_weights_bucket_megabytes=1, sync_timeout_seconds=60)


@pytest.fixture(scope="module")
def deployment():
    source: Any = ray.remote(PolicySource).remote(CONFIG, MODEL)
    worker: Any = ray.remote(RolloutWorker).remote(CONFIG, MODEL, 1.0, 1)
    replica = RayRolloutReplica([worker], name="replica-0")
    manager = CheckpointEngineManager(CONFIG, RayWorkerGroup([source]), [replica])
    manager.update_weights_sync(global_steps=0)
    yield source, worker, manager
    for handle in (source, worker):
        ray.kill(handle)


async def _generating_while(worker: Any, syncs, prompt: torch.Tensor = PROMPT,
                            tokens: int = 12) -> list[dict[str, Any]]:
    """Keep ``worker`` generating (one request after another) while ``syncs()`` runs."""
    samples: list[dict[str, Any]] = []
    done = asyncio.Event()

    async def client() -> None:
        seed = 0
        while not done.is_set():
            samples.append(await worker.generate_sample.remote(prompt, tokens, seed))
            seed += 1

    task = asyncio.ensure_future(client())
    try:
        await syncs()
    finally:
        done.set()
        await task
    return samples


def test_a_generating_client_sees_only_whole_versions_and_ends_on_the_actors(deployment):
    source, worker, manager = deployment

    async def syncs() -> None:
        for step in range(1, 6):
            await source.step.remote(step, 1.0)
            metrics = await manager.update_weights(global_steps=step)
            assert metrics["weightsync/staged"] == 1.0
            await asyncio.sleep(0.05)

    samples = asyncio.run(_generating_while(worker, syncs))
    assert len(samples) > 5, "the client was not served while the syncs ran"
    for sample in samples:
        versions = sample["versions"]
        assert set(versions) <= set(range(6)), versions
        assert versions == sorted(versions), f"a response went back a version: {versions}"
    assert ray.get(worker.weights_checksum.remote()) == ray.get(source.checksum.remote())
    served = ray.get(worker.generate_sample.remote(PROMPT, 12, 1234))
    assert served["versions"] == [5] * 12
    expected = hf_sampled_tokens(MODEL, ray.get(source.state_dict.remote()), PROMPT, 1234, 12)
    assert torch.equal(served["tokens"], expected)


def test_a_stage_refused_in_phase_one_leaves_the_client_served_on_its_version(deployment):
    source, worker, manager = deployment
    version = ray.get(worker.weights_status.remote())["version"]
    wider = MODEL.__class__(**{**vars(MODEL), "intermediate_size": 2 * MODEL.intermediate_size})
    other: Any = ray.remote(PolicySource).remote(CONFIG, wider)
    wrong = CheckpointEngineManager(CONFIG, RayWorkerGroup([other]), manager.replicas)
    errors: list[BaseException] = []

    async def failing_sync() -> None:
        await asyncio.sleep(0.05)
        try:
            await wrong.update_weights(global_steps=99)
        except SyncStageError as error:
            errors.append(error)
        await asyncio.sleep(0.05)

    try:
        samples = asyncio.run(_generating_while(worker, failing_sync))
    finally:
        ray.kill(other)
    assert errors and "mlp" in str(errors[0]) and "Nothing was committed" in str(errors[0])
    assert samples and all(set(s["versions"]) == {version} for s in samples)
    status = manager.weights_status_sync()["replica 0"]
    assert (status["state"], status["version"], status["staged_version"]) == (
        "serving", version, None)
    ray.get(source.step.remote(50, 1.0))
    manager.update_weights_sync(global_steps=50)
    assert ray.get(worker.weights_checksum.remote()) == ray.get(source.checksum.remote())


def test_a_sender_killed_mid_stage_leaves_the_client_served_and_the_next_sync_exact():
    """Phase 1 fault with a generating client: the actor rank dies after a few tensors of
    the stage (a 99.5M-parameter model, so that the stage lasts). The sync fails naming it;
    the replica never stopped serving version 0 and takes the next sync exactly."""
    model = MODELS["100m"]
    prompt = torch.randint(0, model.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    source: Any = ray.remote(PolicySource).remote(CONFIG, model)
    worker: Any = ray.remote(RolloutWorker).remote(CONFIG, model, 1.0, 1)
    replicas = [RayRolloutReplica([worker], name="replica-0")]
    replacement: Any = None
    try:
        manager = CheckpointEngineManager(CONFIG, RayWorkerGroup([source]), replicas)
        manager.update_weights_sync(global_steps=0)
        ray.get(source.step.remote(1, 1.0))
        errors: list[BaseException] = []

        async def killed_sync() -> None:
            syncing = asyncio.ensure_future(manager.update_weights(global_steps=1))
            while not syncing.done():  # kill the sender once the stage has begun
                progress = await worker.execute_checkpoint_engine.remote("sync_progress")
                if progress["tensors"] >= 3:
                    ray.kill(source)
                    break
                await asyncio.sleep(0.01)
            try:
                await syncing
            except SyncStageError as error:
                errors.append(error)
            await asyncio.sleep(0.2)

        samples = asyncio.run(_generating_while(worker, killed_sync, prompt, 4))
        assert errors, "the sender was not killed before the sync ended"
        assert "actor_wg rank 0" in str(errors[0]) and "Nothing was committed" in str(errors[0])
        assert samples and all(set(sample["versions"]) == {0} for sample in samples)
        status = manager.weights_status_sync()["replica 0"]
        assert (status["state"], status["version"]) == ("serving", 0)
        replacement = ray.remote(PolicySource).remote(CONFIG, model)
        CheckpointEngineManager(CONFIG, RayWorkerGroup([replacement]), replicas
                                ).update_weights_sync(global_steps=2)
        assert ray.get(worker.weights_checksum.remote()) == ray.get(replacement.checksum.remote())
    finally:
        for handle in (source, worker, replacement):
            if handle is not None:
                ray.kill(handle)
