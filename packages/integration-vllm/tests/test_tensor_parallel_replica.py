"""A vLLM replica with ``tensor_parallel_size=2`` on CPU (its two vLLM workers in processes of
their own): each worker is one rank of the sync and receives a full copy, vLLM's loaders keep
its shard, and the greedy tokens after each sync equal Hugging Face's on the same weights
(three syncs in a row over gloo, one over nixl). One vLLM engine serves the module."""

import os

import pytest
import ray
import torch
from vllm_sync_support import running_rollout

from weightsync_vllm import VLLMReplica, VLLMRolloutWorker

PROMPTS = torch.randint(0, 8192, (2, 5), generator=torch.Generator().manual_seed(4))
NEW_TOKENS = 4


def _cores_per_worker(workers: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` splitting this process's CPUs between ``workers`` (vLLM
    binds its CPU workers one per NUMA node otherwise, and refuses with fewer nodes)."""
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // workers)
    return "|".join(",".join(map(str, cpus[i * share:(i + 1) * share]))
                    for i in range(workers))


@pytest.fixture(scope="module")
def rollout(model_path):
    with running_rollout(VLLMRolloutWorker, model_path, {"tensor_parallel_size": 2},
                         {"VLLM_CPU_OMP_THREADS_BIND": _cores_per_worker(2)}) as worker:
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
