"""vLLM as its servers run it: ``AsyncLLM`` with its engine core and its worker in processes
of their own (every call between them msgpack), receiving over every CPU backend; three
syncs in a row each give Hugging Face's greedy tokens, and so do five kimi syncs by one
manager (whose plans carry the actor ranks' cached shares, dtypes included, from the second
on). Every failure the in-process tests cover (the sender failing at each tensor, a wrong
shape or an unknown name at a first and a later sync, a first sync missing a tensor, a
killed sender), each followed by vLLM's own ``resume_generation`` and a request straight to
vLLM: the engine keeps running (it serves the mix of versions the failed sync left, which
weightsync's worker refuses to serve), and the next sync brings exactly the sender's weights.
For a model with untied and one with tied embeddings (the tied one's LM head is never sent);
one AsyncLLM per model."""

import pytest
import ray
import torch
from vllm_sync_support import Sender, running_rollout, sync_config
from vllm_test_actors import ProbedAsyncWorker

from weightsync_core import SyncStageError
from weightsync_core.testing.profile import sample
from weightsync_core.testing.weights import Faults
from weightsync_vllm.model_source import save_qwen2

PROMPTS = torch.randint(0, 8192, (3, 6), generator=torch.Generator().manual_seed(3))
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["untied", "tied"])
def model_path(request, tmp_path_factory) -> str:
    """The 2-layer Qwen2 of the other modules, untied and tied (the module's sender and
    rollout follow it)."""
    return save_qwen2(str(tmp_path_factory.mktemp(request.param)), hidden_size=64,
                      vocab_size=8192, tie_word_embeddings=request.param == "tied")


@pytest.fixture(scope="module")
def rollout(model_path):
    with running_rollout(ProbedAsyncWorker, model_path) as worker:
        yield worker


def _generate(rollout) -> torch.Tensor:
    return ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0))


@pytest.mark.parametrize("backend", ["gloo", "nixl", "mooncake", "kimi"])
def test_three_syncs_in_a_row_give_hf_tokens(backend, rollout, source):
    for _ in range(3):
        before = _generate(rollout)
        expected = source.perturb(PROMPTS, NEW_TOKENS)
        assert not torch.equal(before, expected), "the perturbed weights must change the tokens"
        source.sync_into(rollout, backend)
        assert torch.equal(_generate(rollout), expected)
        assert not ray.get(rollout.engine_paused.remote())


def test_five_kimi_syncs_by_one_manager_give_hf_tokens(rollout, source):
    """From the second sync on, kimi's plan for the replica's leader carries the share each
    actor rank cached at the last one (its tensors' dtypes included); it crosses vLLM's
    MessagePack into the worker as plain data (before, every sync after the first failed:
    ``Object of type <class 'torch.dtype'> is not serializable``)."""
    manager = source.manager_into(rollout, "kimi")  # one manager: the sender's engine is kept
    for sync in range(5):
        before = _generate(rollout)
        expected = source.perturb(PROMPTS, NEW_TOKENS)
        assert not torch.equal(before, expected), "the perturbed weights must change the tokens"
        manager.update_weights(200 + sync)
        assert torch.equal(_generate(rollout), expected), sync
        assert ray.get(rollout.weights_status.remote()) == {"version": 200 + sync,
                                                            "complete": True,
                                                            "adapters": {}}


@pytest.mark.parametrize("backend", ["gloo", "nixl"])
def test_ten_delta_syncs_give_hf_tokens(backend, rollout, source):
    """Delta sync into vLLM: after the first full sync, every sync sends patches of the 2%
    of elements that changed; vLLM's worker rebuilds whole tensors (its host copy), checks
    each against the sender's digest and loads them; the tokens are Hugging Face's."""
    manager = source.manager_into(rollout, backend, delta=True)
    tokens_changed = 0
    for sync in range(10):
        before = _generate(rollout)
        expected = source.perturb(PROMPTS, NEW_TOKENS, fraction=0.02)
        metrics = manager.update_weights(100 + sync)
        assert metrics["weightsync/delta"] == (1.0 if sync else 0.0), (sync, metrics)
        assert torch.equal(_generate(rollout), expected), sync
        tokens_changed += not torch.equal(before, expected)
    assert 0.0 < metrics["weightsync/changed_fraction"] < 0.05, metrics
    assert metrics["weightsync/bytes"] < metrics["weightsync/model_bytes"] / 5, metrics
    assert tokens_changed >= 5, "the sparse changes must change the tokens"


def _fails_then_vllm_resumes(rollout, sender, faults: Faults, match: str) -> None:
    """A sync from ``sender`` misbehaving as ``faults`` says fails with ``match`` in its
    error; vLLM's own resume then serves (the engine lives) while weightsync's worker
    refuses."""
    with pytest.raises(SyncStageError) as failure:
        sender.sync_into(rollout, faults=faults)
    assert match in str(failure.value), failure.value
    assert ray.get(rollout.weights_status.remote())["complete"] is False
    assert ray.get(rollout.engine_paused.remote())
    ray.get(rollout.resume_generation.remote())
    served = ray.get(rollout.generate_anyway.remote(PROMPTS, NEW_TOKENS))
    assert served.shape == (PROMPTS.shape[0], NEW_TOKENS)
    with pytest.raises(ray.exceptions.RayTaskError, match="did not complete"):
        _generate(rollout)


def _recovers(rollout, source, expected: torch.Tensor) -> None:
    source.sync_into(rollout)
    assert ray.get(rollout.weights_status.remote())["complete"] is True
    assert torch.equal(_generate(rollout), expected)


def _first_sync_next(rollout) -> None:
    """A fresh transfer engine in vLLM's worker: the next sync is its first."""
    ray.get(rollout.set_checkpoint_engine.remote(sync_config("gloo", timeout=61)))
    ray.get(rollout.set_checkpoint_engine.remote(sync_config("gloo")))


def test_a_sender_failing_at_every_tensor_then_vllms_resume_keeps_vllm_running(
    rollout, source
):
    names = ray.get(source.actor.tensor_names.remote())
    # every tensor in the long profile; the first, the last and two between by default
    for index in sample(range(len(names)), 4):
        print(f"failing at tensor {index} of {len(names)}")
        expected = source.perturb(PROMPTS, NEW_TOKENS)
        _fails_then_vllm_resumes(rollout, source, Faults(raise_after=index), "injected failure")
        _recovers(rollout, source, expected)


@pytest.mark.parametrize("first", [True, False], ids=["first-sync", "later-sync"])
@pytest.mark.parametrize("fault", ["reshape", "rename"])
def test_a_refused_tensor_then_vllms_resume_keeps_vllm_running(rollout, source, fault, first):
    names = ray.get(source.actor.tensor_names.remote())
    name = names[len(names) // 2]
    if first:
        _first_sync_next(rollout)
    expected = source.perturb(PROMPTS, NEW_TOKENS)
    _fails_then_vllm_resumes(
        rollout, source, Faults(**{fault: name}),
        f"tensor {name!r}" if fault == "reshape" else f"{name}.unknown",
    )
    _recovers(rollout, source, expected)


def test_a_first_sync_missing_a_tensor_then_vllms_resume_keeps_vllm_running(rollout, source):
    name = ray.get(source.actor.tensor_names.remote())[3]
    _first_sync_next(rollout)
    expected = source.perturb(PROMPTS, NEW_TOKENS)
    _fails_then_vllm_resumes(rollout, source, Faults(omit=name),
                             "did not deliver 1 of the model's tensors")
    _recovers(rollout, source, expected)


def test_a_killed_sender_then_vllms_resume_keeps_vllm_running(rollout, source, model_path):
    doomed = Sender(model_path)
    try:
        doomed.perturb(PROMPTS, NEW_TOKENS)
        names = ray.get(doomed.actor.tensor_names.remote())
        _fails_then_vllm_resumes(rollout, doomed, Faults(die_after=len(names) // 2),
                                 "actor_wg rank 0")
    finally:
        doomed.kill()
    expected = source.perturb(PROMPTS, NEW_TOKENS)
    _recovers(rollout, source, expected)
