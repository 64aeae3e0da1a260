"""vLLM as its servers run it: ``AsyncLLM`` with its engine core and its worker in processes
of their own (every call between them msgpack), receiving over every CPU backend; three
syncs in a row each give Hugging Face's greedy tokens. A failed sync, then vLLM's own
``resume_generation`` and a request straight to vLLM: the engine keeps running (it serves the
mix of versions the failed sync left, which weightsync's worker refuses to serve), and the
next sync brings exactly the sender's weights. One AsyncLLM serves the whole module."""

import pytest
import ray
import torch
from vllm_sync_support import running_rollout
from vllm_test_actors import ProbedAsyncWorker

from weightsync_core import SyncStageError
from weightsync_core.testing.weights import Faults

PROMPTS = torch.randint(0, 8192, (3, 6), generator=torch.Generator().manual_seed(3))
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def rollout(model_path):
    with running_rollout(ProbedAsyncWorker, model_path) as worker:
        yield worker


def _generate(rollout) -> torch.Tensor:
    return ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0))


@pytest.mark.parametrize("backend", ["gloo", "nixl", "mooncake", "kimi"])
def test_three_syncs_in_a_row_give_hf_tokens(backend, rollout, source):
    for _ in range(3):
        expected = source.perturb(PROMPTS, NEW_TOKENS)
        source.sync_into(rollout, backend)
        assert torch.equal(_generate(rollout), expected)
        assert not ray.get(rollout.engine_paused.remote())


def test_vllm_resumed_after_a_failed_sync_keeps_running_and_the_next_sync_recovers(
    rollout, source
):
    source.perturb(PROMPTS, NEW_TOKENS)
    name = "model.layers.0.self_attn.k_proj.weight"  # mid-layer: q_proj was loaded
    with pytest.raises(SyncStageError, match=f"{name}.unknown"):
        source.sync_into(rollout, faults=Faults(rename=name))
    assert ray.get(rollout.engine_paused.remote())  # the manager left vLLM paused
    ray.get(rollout.resume_generation.remote())  # vLLM's own resume_generation
    assert not ray.get(rollout.engine_paused.remote())
    served = ray.get(rollout.generate_anyway.remote(PROMPTS, NEW_TOKENS))  # vLLM still runs
    assert served.shape == (PROMPTS.shape[0], NEW_TOKENS)
    with pytest.raises(ray.exceptions.RayTaskError, match="did not complete"):
        _generate(rollout)

    expected = source.perturb(PROMPTS, NEW_TOKENS)
    source.sync_into(rollout)
    assert torch.equal(_generate(rollout), expected)
