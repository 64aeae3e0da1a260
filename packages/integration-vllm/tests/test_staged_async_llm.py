"""Staged syncs into vLLM's AsyncLLM (StagedAsyncVLLMRolloutWorker): a client generates
all the time while each version streams into vLLM's worker and is checked (phase 1), then
vLLM pauses in ``keep`` mode for one layerwise reload (phase 2); the client never gets an
error, and after each sync vLLM's greedy tokens are Hugging Face's on the sender's weights,
full and delta. A stage refused in phase 1 (a tensor vLLM's model does not have, a sender
failing mid-stream) leaves vLLM serving the version it served, not paused, and the next
sync is exact."""

import threading

import pytest
import ray
import torch
from vllm_sync_support import running_rollout
from vllm_test_actors import ProbedStagedWorker

from weightsync_core import SyncStageError
from weightsync_core.testing.weights import Faults

PROMPTS = torch.randint(0, 8192, (3, 6), generator=torch.Generator().manual_seed(5))
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def rollout(model_path):
    with running_rollout(ProbedStagedWorker, model_path) as worker:
        yield worker


def _generate(rollout) -> torch.Tensor:
    return ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0))


class _Client:
    """Requests to ``rollout``, one after another on a thread, until stopped; what they
    raised is kept."""

    def __init__(self, rollout) -> None:
        self.rollout, self.served, self.errors = rollout, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _generate(self.rollout)
                self.served += 1
            except Exception as error:
                self.errors.append(error)

    def __enter__(self) -> "_Client":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_staged_syncs_while_a_client_generates_give_hf_tokens(delta, rollout, source):
    manager = source.manager_into(rollout, "gloo", delta=delta)
    assert manager.stages_syncs()
    for sync in range(3):
        expected = source.perturb(PROMPTS, NEW_TOKENS, fraction=0.05 if delta else 1.0)
        with _Client(rollout) as client:
            metrics = manager.update_weights(400 + 10 * delta + sync)
        assert client.errors == [] and client.served > 0
        assert metrics["weightsync/staged"] == 1.0
        assert 0 < metrics["weightsync/pause_seconds"] < metrics["weightsync/seconds/total"]
        assert torch.equal(_generate(rollout), expected), sync
    status = ray.get(rollout.weights_status.remote())
    assert status == {"version": 402 + 10 * delta, "complete": True, "staged_version": None,
                      "rollback_version": 402 + 10 * delta}  # its copy, for the next
    assert not ray.get(rollout.engine_paused.remote())


@pytest.mark.parametrize("fault", [Faults(rename="model.layers.0.mlp.up_proj.weight"),
                                   Faults(raise_after=5)], ids=["unknown name", "sender raises"])
def test_a_stage_refused_in_phase_one_leaves_vllm_serving_its_version(fault, rollout, source):
    manager = source.manager_into(rollout, "gloo")
    served = source.perturb(PROMPTS, NEW_TOKENS)
    manager.update_weights(500)
    assert torch.equal(_generate(rollout), served)
    manager = source.manager_into(rollout, "gloo", faults=fault)
    with _Client(rollout) as client, pytest.raises(
            SyncStageError, match="Nothing was committed") as info:
        manager.update_weights(501)
    assert info.value.stage == "transfer", str(info.value)
    assert client.errors == []
    assert torch.equal(_generate(rollout), served)
    assert ray.get(rollout.weights_status.remote())["version"] == 500
    assert not ray.get(rollout.engine_paused.remote())
    expected = source.perturb(PROMPTS, NEW_TOKENS)
    source.manager_into(rollout, "gloo").update_weights(502)
    assert torch.equal(_generate(rollout), expected)
