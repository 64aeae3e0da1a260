"""A vLLM replica with ``tensor_parallel_size=2`` on CPU (its two vLLM workers in processes of
their own): each worker is one rank of the sync and receives a full copy, vLLM's loaders keep
its shard, and the greedy tokens after each sync equal Hugging Face's on the same weights
(three syncs in a row over gloo, one over nixl). Over a sharded backend each worker receives
only its own slices (about half the model). A sync that fails on both workers leaves a
replica that refuses to serve, and the next sync recovers it (vLLM's executor would otherwise
answer later calls with the failed call's replies); so does a failed sharded sync, whose
workers are still receiving when the manager aborts them. The actor put in a plain
``RayRolloutReplica`` is refused before any byte moves, naming ``VLLMReplica``. For vLLM's
``LLM`` in the actor's process and for ``AsyncLLM`` (its engine core in a process of its own);
one vLLM engine for each."""

import pytest
import ray
import torch
from vllm_sync_support import running_rollout

from weightsync_core import SyncStageError
from weightsync_core.testing.profile import by_profile
from weightsync_core.testing.weights import Faults
from weightsync_vllm import AsyncVLLMRolloutWorker, VLLMReplica, VLLMRolloutWorker
from weightsync_vllm.tensor_parallel import cpu_threads_bind

PROMPTS = torch.randint(0, 8192, (2, 5), generator=torch.Generator().manual_seed(4))
NEW_TOKENS = 4
FAILING_TIMEOUT = by_profile(default=6, long=10)
"""The sync timeout of the failing sharded sync, which a vLLM worker waiting for a piece its
sibling was to relay ends only at its timeout: a healthy sync of this model takes about a
second."""


@pytest.fixture(scope="module", params=[VLLMRolloutWorker, AsyncVLLMRolloutWorker],
                ids=["LLM", "AsyncLLM"])
def rollout(request, model_path):
    with running_rollout(request.param, model_path, {"tensor_parallel_size": 2},
                         {"VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind(2)}) as worker:
        yield worker


@pytest.mark.parametrize(("backend", "syncs"), [("gloo", 3), ("nixl", 1)])
def test_each_vllm_worker_of_a_tp2_replica_is_a_rank_and_tokens_equal_hf(
    backend, syncs, rollout, source
):
    replica = VLLMReplica(rollout, tensor_parallel_size=2)
    for _ in range(syncs):
        expected = source.perturb(PROMPTS, NEW_TOKENS)
        before = ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0))
        assert not torch.equal(before, expected), "the perturbed weights must change the tokens"

        source.sync_into(rollout, backend, replica=replica)

        # a worker that missed the sync would serve its shard of the old weights
        assert torch.equal(ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0)), expected)


@pytest.mark.parametrize("backend", ["gloo_sharded", "nixl_sharded"])
def test_a_sharded_sync_sends_each_worker_of_a_tp2_replica_its_half_and_tokens_equal_hf(
    backend, rollout, source
):
    """Each vLLM worker declares its tensor-parallel slices (Qwen2 as vLLM shards it; the
    test model's one KV head is replicated on both) and receives only those, which vLLM's
    loaders take from a tensor of the checkpoint's shape rebuilt around them."""
    replica = VLLMReplica(rollout, tensor_parallel_size=2)
    whole = ray.get(source.actor.weights_bytes.remote())
    for _ in range(2):
        expected = source.perturb(PROMPTS, NEW_TOKENS)
        source.sync_into(rollout, backend, replica=replica)
        assert torch.equal(ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0)), expected)

    received = [ray.get(rollout.last_update_stats.remote(worker))["nbytes"] for worker in (0, 1)]
    print(f"{backend}: a full copy is {whole} bytes; the TP=2 workers received {received} "
          f"({', '.join(f'{nbytes / whole:.0%}' for nbytes in received)})")
    # half of every split tensor, plus the replicated norms and the one KV head
    assert all(0.5 * whole < nbytes < 0.6 * whole for nbytes in received), received


def test_a_tp2_actor_in_a_plain_replica_is_refused_naming_vllm_replica(rollout, source):
    """Both workers would act as the same rank of the sync; the first stage refuses."""
    with pytest.raises(SyncStageError, match=r"VLLMReplica\(actor, tensor_parallel_size=2\)"):
        source.sync_into(rollout)  # a one-worker RayRolloutReplica of the actor

    expected = source.perturb(PROMPTS, NEW_TOKENS)
    source.sync_into(rollout, replica=VLLMReplica(rollout, tensor_parallel_size=2))
    assert torch.equal(ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0)), expected)


def test_a_sync_failing_on_both_workers_leaves_a_refusing_replica_that_the_next_sync_recovers(
    rollout, source
):
    replica = VLLMReplica(rollout, tensor_parallel_size=2)
    names = ray.get(source.actor.tensor_names.remote())
    source.perturb(PROMPTS, NEW_TOKENS)
    with pytest.raises(SyncStageError, match="injected failure"):
        source.sync_into(rollout, faults=Faults(raise_after=len(names) // 2), replica=replica)
    with pytest.raises(ray.exceptions.RayTaskError, match="did not complete"):
        ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0))

    for _ in range(2):  # each call of the engine gets its own replies again
        expected = source.perturb(PROMPTS, NEW_TOKENS)
        source.sync_into(rollout, replica=replica)
        assert torch.equal(ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0)), expected)


@pytest.mark.parametrize("backend", ["gloo_sharded", "nixl_sharded"])
def test_a_failed_sharded_sync_leaves_a_tp2_replica_that_the_next_syncs_recover(
    backend, rollout, source
):
    """The sender fails half-way through a sharded sync: the replica refuses to serve, and
    the next two syncs over the same backend give Hugging Face's tokens. Before, the
    in-process ``LLM`` replica never synced again: a call of the manager's (its ``abort``)
    entered vLLM's executor while the failed ``update_weights`` was still in it, the two
    read each other's replies, and every later sync failed at ``locate``
    (``rollout_rank_hosts[0] must be a host name (str), got None``). The failed sync runs
    under a short timeout (:data:`FAILING_TIMEOUT`): a vLLM worker may wait that long for a
    piece its sibling was to relay (``nixl_sharded``), and the manager's ``abort`` reaches no
    worker before then."""
    replica = VLLMReplica(rollout, tensor_parallel_size=2)
    names = ray.get(source.actor.tensor_names.remote())
    source.perturb(PROMPTS, NEW_TOKENS)
    failing = source.manager_into(rollout, backend, Faults(raise_after=len(names) // 2),
                                  replica, sync_timeout_seconds=FAILING_TIMEOUT)
    with pytest.raises(SyncStageError, match="injected failure"):
        failing.update_weights(1)
    with pytest.raises(ray.exceptions.RayTaskError, match="did not complete"):
        ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0))

    for _ in range(2):
        expected = source.perturb(PROMPTS, NEW_TOKENS)
        source.sync_into(rollout, backend, replica=replica)
        assert torch.equal(ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0)), expected)
