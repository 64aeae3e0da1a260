"""Device check: the correctness test on a CUDA GPU with vLLM's CUDA build (``uv sync
--package weightsync-vllm --extra cuda``). Skipped elsewhere, with the reason. Not yet run:
no GPU machine was lent to the work that wrote it."""

import pytest
import ray
import torch
import transformers

from weightsync_core import (
    CheckpointEngineConfig,
    CheckpointEngineManager,
    RayRolloutReplica,
    RayWorkerGroup,
)
from weightsync_vllm.model_source import ModelWeightsSource, perturb_, save_qwen2
from weightsync_vllm.worker import VLLMRolloutWorker

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU and vLLM's CUDA build (uv sync --package weightsync-vllm "
           "--extra cuda)",
)

PROMPTS = torch.randint(0, 8192, (4, 6), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("backend", ["gloo", "nixl"])
def test_vllm_on_a_gpu_generates_what_hf_generates_after_a_sync(backend, tmp_path):
    config = CheckpointEngineConfig(backend=backend, update_weights_bucket_megabytes=1,
                                    sync_timeout_seconds=120)
    model_path = save_qwen2(str(tmp_path), hidden_size=64, vocab_size=8192)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_path,
                                                                  dtype=torch.float32)
    perturb_(reference, seed=3)
    expected = reference.generate(PROMPTS, attention_mask=torch.ones_like(PROMPTS),
                                  do_sample=False, max_new_tokens=8,
                                  pad_token_id=0)[:, PROMPTS.shape[1]:]
    rollout = ray.remote(num_gpus=1, num_cpus=0)(VLLMRolloutWorker).remote(
        config, model_path, engine_args={"gpu_memory_utilization": 0.3}, temperature=0.0)
    source = ray.remote(num_cpus=0)(ModelWeightsSource).remote(config, model_path)
    try:
        ray.get(source.perturb.remote(3))
        manager = CheckpointEngineManager(config, RayWorkerGroup([source]),
                                          [RayRolloutReplica([rollout])])
        manager.update_weights(1)
        tokens = ray.get(rollout.generate.remote(PROMPTS, 8, 0))
    finally:
        ray.get(rollout.shutdown.remote())
        for actor in (rollout, source):
            ray.kill(actor)
    assert torch.equal(tokens, expected)
