"""An HF replica fed block-FP8 weights (``rollout_quantization="fp8_block"``, real Ray actors,
real gloo): the sender quantizes, the replica dequantizes to its compute dtype (bf16) on load,
staged (the stage swapped in) and stop-the-world (streamed in), full and delta syncs; after
each sync it serves exactly the weights of a reference FP8 model dequantized here block by
block, and samples its tokens. The same for a tensor-parallel replica of two workers fed
through ``gloo_sharded``: each worker receives its float8 slices (some cutting blocks) and the
scales of the blocks they touch, and dequantizes them slice by slice."""

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
from weightsync_trainer.config import ModelConfig
from weightsync_trainer.modeling import build_policy_model
from weightsync_trainer.workers.rollout import RolloutWorker

MODEL = MODELS["tiny"]
BLOCKS = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=320, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
"""Weights of several 128x128 blocks; TP=2 cuts k/v (128 rows) and the MLP (320) mid-block."""
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
    _check_three_syncs(manager, source, worker, MODEL, 100 * (staging == "never"),
                       1.0 if staging == "auto" else 0.0)
    bf16 = {name: tensor.to(torch.bfloat16)
            for name, tensor in ray.get(source.state_dict.remote()).items()}
    assert ray.get(worker.weights_checksum.remote()) != weights_digest(bf16.items())


def _check_three_syncs(manager: CheckpointEngineManager, source: Any, worker: Any,
                       model: ModelConfig, seed: int, staged: float) -> None:
    """Three syncs (the first of every element, then 2%): after each, ``worker`` serves the
    reference FP8 model's weights and samples its tokens."""
    for sync in range(3):
        ray.get(source.step.remote(seed + sync, 0.02 if sync else 1.0))
        metrics = manager.update_weights_sync(global_steps=sync)
        assert metrics["weightsync/staged"] == staged
        state = _fp8_model_state(ray.get(source.state_dict.remote()))
        reference = build_policy_model(model).to(torch.bfloat16)
        reference.load_state_dict(state)
        assert ray.get(worker.weights_checksum.remote()) == weights_digest(
            reference.named_parameters()), sync
        served = ray.get(worker.generate_sample.remote(PROMPT, 12, 77 + sync))["tokens"]
        assert torch.equal(served, hf_sampled_tokens(model, state, PROMPT, 77 + sync, 12))


@pytest.mark.parametrize("staging", ["auto", "never"])
def test_a_tensor_parallel_fp8_replica_dequantizes_its_slices(staging):
    config = replace(CONFIG, backend="gloo_sharded", staging=staging)
    source: Any = ray.remote(PolicySource).remote(config, BLOCKS)
    workers: list[Any] = [ray.remote(RolloutWorker).remote(config, BLOCKS, 1.0, 1,
                                                           tensor_parallel=(2, rank))
                          for rank in range(2)]
    try:
        ray.get([worker.set_tensor_parallel_peers.remote(
            [peer for peer in workers if peer is not worker]) for worker in workers])
        manager = CheckpointEngineManager(config, RayWorkerGroup([source]),
                                          [RayRolloutReplica(workers, name="fp8-tp")])
        _check_three_syncs(manager, source, workers[0], BLOCKS, 200,
                           1.0 if staging == "auto" else 0.0)
        assert ray.get(workers[1].weights_checksum.remote()) == ray.get(
            workers[0].weights_checksum.remote())
    finally:
        for handle in (source, *workers):
            ray.kill(handle)
