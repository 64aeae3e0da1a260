"""What one worker of a tensor-parallel vLLM engine needs of each checkpoint tensor, as a
layout sharded backends deliver (``gloo_sharded``, ``nixl_sharded``, ``mooncake_sharded``),
and the whole tensor rebuilt around a received piece for vLLM's loaders, which cut the
worker's shard out of a whole checkpoint tensor."""

from __future__ import annotations

import logging
from typing import Any

import torch

from weightsync_core import VerificationError
from weightsync_core.data.shards import (
    Box,
    DecoderShape,
    LayoutSpec,
    MoEShape,
    moe_spec,
    tensor_parallel_spec,
)

__all__ = ["MOE_ARCHITECTURES", "SHARDED_ARCHITECTURES", "tensor_parallel_layout_spec",
           "whole_tensor"]

logger = logging.getLogger(__name__)

MOE_ARCHITECTURES = frozenset({"Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})
"""Mixture-of-experts models whose split core's
:func:`~weightsync_core.data.shards.moe_layout` follows (experts by tensor or by expert)."""

SHARDED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"}) | MOE_ARCHITECTURES
"""Models whose tensor-parallel split core's layouts follow
(:func:`~weightsync_core.data.shards.decoder_tensor_parallel_layout`, and for
:data:`MOE_ARCHITECTURES` :func:`~weightsync_core.data.shards.moe_layout`); workers of other
models receive every tensor whole."""


def tensor_parallel_layout_spec(hf_config: Any, tp_size: int, tp_rank: int,
                                expert_parallel: bool = False) -> LayoutSpec | None:
    """What tensor-parallel rank ``tp_rank`` of ``tp_size`` needs of the model of
    ``hf_config`` (a Hugging Face config; ``expert_parallel``: vLLM's
    ``enable_expert_parallel``, each worker holding whole experts of a mixture of experts),
    or None (every tensor whole) with one worker or a model of another family than
    :data:`SHARDED_ARCHITECTURES`."""
    if tp_size == 1:
        return None
    architectures = set(getattr(hf_config, "architectures", None) or ())
    if not architectures & SHARDED_ARCHITECTURES:
        logger.info("weightsync: %s is not of %s; each worker receives whole tensors",
                    sorted(architectures), sorted(SHARDED_ARCHITECTURES))
        return None
    if architectures & MOE_ARCHITECTURES:
        return moe_spec(MoEShape.from_hf_config(hf_config), tp_size, tp_rank, expert_parallel)
    return tensor_parallel_spec(DecoderShape.from_hf_config(hf_config), tp_size, tp_rank)


def whole_tensor(name: str, piece: torch.Tensor, box: Box, shape: tuple[int, ...]
                 ) -> torch.Tensor:
    """A tensor of the checkpoint's ``shape`` holding ``piece`` at ``box`` (zeros elsewhere,
    which vLLM's loader of this worker's shard never reads); ``piece`` itself when it is the
    whole tensor.

    Raises:
        VerificationError: ``piece`` is not of its box's shape, naming the tensor.
    """
    if tuple(piece.shape) == tuple(shape):
        return piece
    if tuple(piece.shape) != box.shape:
        raise VerificationError(
            f"tensor {name!r} arrived as a piece of shape {list(piece.shape)}, but this vLLM "
            f"worker needs rows/columns {list(box.ranges)} of its {list(shape)}; refused "
            "before loading it", tensors=[name])
    whole = piece.new_zeros(shape)
    box.cut(whole).copy_(piece)
    return whole
