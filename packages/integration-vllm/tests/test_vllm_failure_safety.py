"""Whatever fails in a sync into vLLM, the replica ends consistent: the sync fails naming the
cause, the replica refuses to serve (it holds a mix of versions) and the next sync's greedy
tokens equal Hugging Face's on the same weights. A tensor the model does not hold, or holds
with another shape, is refused before it is loaded; a first sync that misses a tensor fails
naming it and never becomes the reference. For a model with untied and one with tied
embeddings (the LM head of the tied one is never sent); one vLLM engine per model (the
untied one the conftest's, shared with ``test_vllm_replica``)."""

import pytest
import ray
import torch
from vllm_sync_support import Sender, sync_config

from weightsync_core import SyncStageError, WeightSyncError
from weightsync_core.testing.profile import sample
from weightsync_core.testing.weights import Faults
from weightsync_vllm.model_source import save_qwen2
from weightsync_vllm.worker import VLLMRolloutWorker

PROMPTS = torch.randint(0, 4096, (2, 5), generator=torch.Generator().manual_seed(2))
NEW_TOKENS = 6


class Replica:
    """A vLLM rollout worker and its sender (with the sender's Hugging Face copy)."""

    def __init__(self, model_path: str, rollout=None) -> None:
        """A rollout worker of its own, or the running ``rollout`` (not shut down after)."""
        self.shared = rollout is not None
        self.rollout = rollout or ray.remote(num_cpus=0)(VLLMRolloutWorker).remote(
            sync_config("gloo"), model_path, temperature=0.0, env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        )
        self.model_path = model_path
        self.sender = Sender(model_path)
        ray.get(self.rollout.__ray_ready__.remote())
        self.names = ray.get(self.sender.actor.tensor_names.remote())

    def new_sender(self) -> None:
        """A new sender (and reference) holding the weights in the model's directory."""
        self.sender = Sender(self.model_path)

    def perturb(self) -> torch.Tensor:
        return self.sender.perturb(PROMPTS, NEW_TOKENS)

    def sync(self, faults: Faults | None = None) -> None:
        self.sender.sync_into(self.rollout, faults=faults)

    def failed_sync(self, faults: Faults, match: str) -> None:
        """A sync that must fail with ``match`` in its error, leaving the replica refusing."""
        with pytest.raises(SyncStageError, match="transfer") as failure:
            self.sync(faults)
        assert match in str(failure.value), failure.value
        assert ray.get(self.rollout.weights_status.remote())["complete"] is False
        with pytest.raises(ray.exceptions.RayTaskError, match="did not complete") as refused:
            self.generate()
        assert isinstance(refused.value.cause, WeightSyncError)

    def recovers(self, expected: torch.Tensor) -> None:
        """The next sync succeeds and the replica serves exactly the sender's weights."""
        self.sync()
        assert ray.get(self.rollout.weights_status.remote())["complete"] is True
        assert torch.equal(self.generate(), expected)

    def first_sync_next(self) -> None:
        """Make the next sync the first of a fresh transfer engine (nothing loaded before)."""
        ray.get(self.rollout.set_checkpoint_engine.remote(sync_config("gloo", timeout=61)))
        ray.get(self.rollout.set_checkpoint_engine.remote(sync_config("gloo")))

    def generate(self) -> torch.Tensor:
        return ray.get(self.rollout.generate.remote(PROMPTS, NEW_TOKENS, 0))

    def close(self) -> None:
        if not self.shared:
            ray.get(self.rollout.shutdown.remote())
            ray.kill(self.rollout)
        self.sender.kill()


@pytest.fixture(scope="module", params=["untied", "tied"])
def replica(request, tmp_path_factory):
    if request.param == "untied":  # the conftest's engine, on the same 1-layer model
        replica = Replica(request.getfixturevalue("one_layer_model_path"),
                          request.getfixturevalue("llm_rollout"))
    else:
        replica = Replica(save_qwen2(str(tmp_path_factory.mktemp(request.param)),
                                     hidden_size=64, num_hidden_layers=1, vocab_size=8192,
                                     tie_word_embeddings=True))
    yield replica
    replica.close()


def test_three_syncs_in_a_row_generate_what_hf_generates(replica):
    for _ in range(3):
        before = replica.generate()
        expected = replica.perturb()
        assert not torch.equal(before, expected), "the perturbed weights must change the tokens"
        replica.sync()
        assert torch.equal(replica.generate(), expected)


def test_sender_failing_at_every_tensor_leaves_a_replica_that_refuses_then_recovers(replica):
    # every tensor in the long profile; the first, the last and two between by default
    for index in sample(range(len(replica.names)), 4):
        print(f"failing at tensor {index} of {len(replica.names)}")
        expected = replica.perturb()
        replica.failed_sync(Faults(raise_after=index), "injected failure")
        replica.recovers(expected)


@pytest.mark.parametrize("first", [True, False], ids=["first-sync", "later-sync"])
def test_a_wrong_shape_is_refused_before_loading_naming_the_tensor(replica, first):
    name = replica.names[len(replica.names) // 2]
    if first:
        replica.first_sync_next()
    expected = replica.perturb()
    replica.failed_sync(Faults(reshape=name), f"tensor {name!r}")
    replica.recovers(expected)


@pytest.mark.parametrize("first", [True, False], ids=["first-sync", "later-sync"])
def test_a_name_the_model_lacks_is_refused_before_loading_naming_it(replica, first):
    name = replica.names[2]
    if first:
        replica.first_sync_next()
    expected = replica.perturb()
    replica.failed_sync(Faults(rename=name), f"{name}.unknown")
    replica.recovers(expected)


def test_a_first_sync_missing_a_tensor_fails_naming_it_and_is_no_reference(replica):
    name = replica.names[3]
    replica.first_sync_next()
    expected = replica.perturb()
    replica.failed_sync(Faults(omit=name), "did not deliver 1 of the model's tensors")
    replica.recovers(expected)  # the full set is accepted: the failed sync is no reference


def test_a_killed_sender_leaves_a_replica_that_refuses_then_recovers(replica):
    replica.perturb()
    with pytest.raises(SyncStageError):
        replica.sync(Faults(die_after=len(replica.names) // 2))
    assert ray.get(replica.rollout.weights_status.remote())["complete"] is False
    with pytest.raises(ray.exceptions.RayTaskError, match="did not complete"):
        replica.generate()
    replica.new_sender()
    expected = replica.perturb()
    replica.recovers(expected)
