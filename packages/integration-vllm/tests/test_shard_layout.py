"""A tensor-parallel vLLM worker's slices, from its model's config, and the checkpoint-shaped
tensor its loaders take, rebuilt around a received piece (a piece of another shape is
refused before loading, naming the tensor)."""

import pytest
import torch
import transformers

from weightsync_core import VerificationError
from weightsync_core.data.shards import Box, resolve_layout
from weightsync_vllm.shard_layout import tensor_parallel_layout_spec, whole_tensor

CONFIG = transformers.Qwen2Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                  intermediate_size=128, architectures=["Qwen2ForCausalLM"])


def test_a_qwen2_worker_needs_its_rows_and_other_models_everything():
    spec = tensor_parallel_layout_spec(CONFIG, 2, 1)
    layout = resolve_layout(spec, {"model.layers.0.mlp.up_proj.weight": (128, 64)}, "worker 1")
    assert layout.boxes["model.layers.0.mlp.up_proj.weight"] == Box(((64, 128), (0, 64)))
    assert tensor_parallel_layout_spec(CONFIG, 1, 0) is None
    other = transformers.Qwen2Config(architectures=["MixtralForCausalLM"])
    assert tensor_parallel_layout_spec(other, 2, 0) is None


def test_a_piece_is_placed_in_a_tensor_of_the_checkpoints_shape():
    box = Box(((2, 4), (0, 3)))
    piece = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    whole = whole_tensor("w", piece, box, (4, 3))
    assert torch.equal(whole[2:4], piece) and not whole[:2].any()


def test_a_piece_of_another_shape_is_refused_naming_the_tensor():
    with pytest.raises(VerificationError, match="tensor 'w' arrived as a piece of shape"):
        whole_tensor("w", torch.zeros(3, 3), Box(((2, 4), (0, 3))), (4, 3))
