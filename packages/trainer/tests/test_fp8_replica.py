"""An HF replica fed block-FP8 weights (``rollout_quantization="fp8_block"``, real Ray actors,
real gloo): the sender quantizes, the replica dequantizes to its compute dtype (bf16) on load,
staged (the stage swapped in) and stop-the-world (streamed in), full and delta syncs; after
each sync it serves exactly the weights of a reference FP8 model dequantized here block by
block, and samples its tokens."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import ray
import torch
from trainer_test_helpers import hf_sampled_tokens

from weightsync_core import (
    CheckpointEngineConfig,
    CheckpointEngineManager,
    RayRolloutReplica,
    RayWorkerGroup,
)
from weightsync_core.data.quantization import quantize_fp8_block, quantizes
from weightsync_trainer.bench_stall import MODELS, PolicySource
from weightsync_trainer.checksum import weights_digest
from weightsync_trainer.modeling import build_policy_model
from weightsync_trainer.workers.rollout import RolloutWorker

MODEL = MODELS["tiny"]
PROMPT = torch.randint(0, MODEL.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
CONFIG = CheckpointEngineConfig(backend="gloo", rollout_dtype="bfloat16",
                                rollout_quantization="fp8_block", delta=True,
                                update_weights_bucket_megabytes=1, sync_timeout_seconds=60)


def _fp8_model_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference FP8 model in bf16: every quantized weight's float8 values times its
    block's scale, block by block; the rest cast to bf16."""
    served = {}
    for name, tensor in state.items():
        if not quantizes(name, tensor):
            served[name] = tensor.to(torch.bfloat16)
            continue
        quantized, scale_inv = quantize_fp8_block(tensor)
        values = torch.empty(tensor.shape, dtype=torch.float32)
        for i in range(scale_inv.shape[0]):
            for j in range(scale_inv.shape[1]):
                rows, columns = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
                values[rows, columns] = quantized[rows, columns].float() * scale_inv[i, j]
        served[name] = values.to(torch.bfloat16)
    return served


@pytest.fixture(scope="module")
def deployment():
    source: Any = ray.remote(PolicySource).remote(CONFIG, MODEL)
    worker: Any = ray.remote(RolloutWorker).remote(CONFIG, MODEL, 1.0, 1)
    yield source, worker
    for handle in (source, worker):
        ray.kill(handle)


@pytest.mark.parametrize("staging", ["auto", "never"])
def test_an_fp8_replica_serves_the_reference_fp8_model_after_each_sync(deployment, staging):
    source, worker = deployment
    manager = CheckpointEngineManager(replace(CONFIG, staging=staging), RayWorkerGroup([source]),
                                      [RayRolloutReplica([worker], name="fp8")])
    for sync in range(3):
        ray.get(source.step.remote(100 * (staging == "never") + sync, 0.02 if sync else 1.0))
        metrics = manager.update_weights_sync(global_steps=sync)
        assert metrics["weightsync/staged"] == (1.0 if staging == "auto" else 0.0)
        state = _fp8_model_state(ray.get(source.state_dict.remote()))
        reference = build_policy_model(MODEL).to(torch.bfloat16)
        reference.load_state_dict(state)
        assert ray.get(worker.weights_checksum.remote()) == weights_digest(
            reference.named_parameters()), sync
        served = ray.get(worker.generate_sample.remote(PROMPT, 12, 77 + sync))["tokens"]
        assert torch.equal(served, hf_sampled_tokens(MODEL, state, PROMPT, 77 + sync, 12))
    bf16 = {name: tensor.to(torch.bfloat16)
            for name, tensor in ray.get(source.state_dict.remote()).items()}
    assert ray.get(worker.weights_checksum.remote()) != weights_digest(bf16.items())
