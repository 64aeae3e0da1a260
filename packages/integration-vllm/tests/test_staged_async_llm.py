"""Staged syncs into vLLM's AsyncLLM (StagedAsyncVLLMRolloutWorker): a client generates
all the time while each version streams into vLLM's worker and is checked (phase 1), then
vLLM pauses in ``keep`` mode for one layerwise reload (phase 2); the client never gets an
error, and after each sync vLLM's greedy tokens are Hugging Face's on the sender's weights,
full and delta. A stage refused in phase 1 (a tensor vLLM's model does not have, a sender
failing mid-stream) leaves vLLM serving the version it served, not paused, and the next
sync is exact. A replica of two vLLM workers (``tensor_parallel_size=2``, a
``StagedVLLMReplica``) stages on both, whole tensors or each its slices, and switches as one;
its phase-1 refusal leaves both serving, and where one worker refuses its stage at the switch,
the other, which took it, is rolled back too: both serve the version they served."""

import threading

import pytest
import ray
import torch
from vllm_sync_support import running_rollout
from vllm_test_actors import ProbedStagedWorker

from weightsync_core import SyncStageError
from weightsync_core.testing.weights import Faults
from weightsync_vllm import StagedVLLMReplica
from weightsync_vllm.tensor_parallel import cpu_threads_bind

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
    # a prepared switch is all or nothing
    assert status == {"version": 402 + 10 * delta, "complete": True, "staged_version": None,
                      "rollback_version": None, "adapters": {}}
    assert not ray.get(rollout.engine_paused.remote())


def test_a_staged_sync_after_a_stop_the_world_one_gives_hf_tokens(rollout, source):
    # vLLM's own reload (the stop-the-world sync's) leaves its wrappers on the model's weight
    # loaders; the staged sync's shadow of the model must load through its own
    source.perturb(PROMPTS, NEW_TOKENS)
    source.manager_into(rollout, "gloo", staging="never").update_weights(450)
    for sync in range(2):
        expected = source.perturb(PROMPTS, NEW_TOKENS)
        metrics = source.manager_into(rollout, "gloo").update_weights(451 + sync)
        assert metrics["weightsync/staged"] == 1.0
        assert torch.equal(_generate(rollout), expected), sync


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


@pytest.fixture(scope="module")
def tp2_rollout(model_path):
    with running_rollout(ProbedStagedWorker, model_path, {"tensor_parallel_size": 2},
                         {"VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind(2)}) as worker:
        yield worker


@pytest.mark.parametrize(("backend", "first"), [("gloo", 600), ("gloo_sharded", 610)])
def test_a_tp2_replica_stages_on_both_workers_and_switches_as_one(backend, first, tp2_rollout,
                                                                  source):
    replica = StagedVLLMReplica(tp2_rollout, tensor_parallel_size=2)
    manager = source.manager_into(tp2_rollout, backend, replica=replica)
    assert manager.stages_syncs()
    expected = source.perturb(PROMPTS, NEW_TOKENS)
    with _Client(tp2_rollout) as client:
        metrics = manager.update_weights(first)
    assert client.errors == [] and client.served > 0
    assert metrics["weightsync/staged"] == 1.0
    assert 0 < metrics["weightsync/pause_seconds"] < metrics["weightsync/seconds/total"]
    assert torch.equal(_generate(tp2_rollout), expected)
    status = manager.weights_status()["replica 0"]
    assert (status["state"], status["version"], status["staged_version"]) == (
        "serving", first, None)
    assert [worker["version"] for worker in status["workers"]] == [first] * 2
    assert not ray.get(tp2_rollout.engine_paused.remote())


def test_a_tp2_stage_refused_in_phase_one_leaves_both_workers_serving(tp2_rollout, source):
    replica = StagedVLLMReplica(tp2_rollout, tensor_parallel_size=2)
    served = source.perturb(PROMPTS, NEW_TOKENS)
    source.manager_into(tp2_rollout, "gloo", replica=replica).update_weights(620)
    manager = source.manager_into(tp2_rollout, "gloo", replica=replica,
                                  faults=Faults(rename="model.layers.0.mlp.up_proj.weight"))
    with _Client(tp2_rollout) as client, pytest.raises(
            SyncStageError, match="Nothing was committed") as info:
        manager.update_weights(621)
    assert info.value.stage == "transfer", str(info.value)
    assert client.errors == []
    assert torch.equal(_generate(tp2_rollout), served)
    status = manager.weights_status()["replica 0"]
    assert (status["state"], status["version"]) == ("serving", 620)
    expected = source.perturb(PROMPTS, NEW_TOKENS)
    source.manager_into(tp2_rollout, "gloo", replica=replica).update_weights(622)
    assert torch.equal(_generate(tp2_rollout), expected)


def test_a_tp2_switch_one_worker_refuses_rolls_both_back(tp2_rollout, source):
    replica = StagedVLLMReplica(tp2_rollout, tensor_parallel_size=2)
    manager = source.manager_into(tp2_rollout, "gloo", replica=replica)
    source.perturb(PROMPTS, NEW_TOKENS)
    manager.update_weights(630)  # a staged commit: each worker keeps a copy to roll back to
    served = source.perturb(PROMPTS, NEW_TOKENS)
    manager.update_weights(631)
    assert torch.equal(_generate(tp2_rollout), served)
    source.perturb(PROMPTS, NEW_TOKENS)
    ray.get(tp2_rollout.refuse_next_commit.remote(1))
    with _Client(tp2_rollout) as client, pytest.raises(
            SyncStageError, match=r"failed at stage 'commit'.*vLLM worker 1 refused its "
            r"stage.*rolled back to the version they served, and serving: \['replica 0'\]"):
        manager.update_weights(632)
    assert client.errors == []
    assert torch.equal(_generate(tp2_rollout), served)
    status = manager.weights_status()["replica 0"]
    assert (status["state"], status["version"]) == ("serving", 631), status
    assert [worker["version"] for worker in status["workers"]] == [631, 631]
    assert not ray.get(tp2_rollout.engine_paused.remote())
    expected = source.perturb(PROMPTS, NEW_TOKENS)
    manager.update_weights(633)
    assert torch.equal(_generate(tp2_rollout), expected)
