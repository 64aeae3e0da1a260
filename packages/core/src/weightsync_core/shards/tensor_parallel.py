"""What a tensor-parallel rollout worker of a Qwen2/Llama-family model needs, as vLLM shards
it: column-parallel layers by rows, row-parallel layers by columns, the rest whole."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from weightsync_core.shards.box import Box
from weightsync_core.shards.layout import Layout, Shapes

__all__ = ["DecoderShape", "decoder_tensor_parallel_layout"]

_VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this before splitting it

_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")
_QUERY = re.compile(r"\.self_attn\.q_proj\.(weight|bias)$")
_KEY_VALUE = re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$")
_ATTENTION_OUT = re.compile(r"\.self_attn\.o_proj\.weight$")
_MLP_IN = re.compile(r"\.mlp\.(gate|up)_proj\.weight$")
_MLP_OUT = re.compile(r"\.mlp\.down_proj\.weight$")


@dataclass(frozen=True)
class DecoderShape:
    """The attention geometry of a decoder model (a Hugging Face config's fields).

    Args:
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (fewer than query heads with grouped-query
            attention).
        head_dim: elements per head (``hidden_size // num_attention_heads`` if not given).
        intermediate_size: the MLP's width.

    Raises:
        ValueError: a field that is not a positive integer, named.
    """

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"DecoderShape {field.name} must be a positive integer, got {value!r}: "
                    "give the model's geometry as its Hugging Face config states it "
                    "(DecoderShape.from_hf_config)"
                )

    @classmethod
    def from_hf_config(cls, config: Any) -> DecoderShape:
        """The geometry of a Hugging Face model config (its ``text_config`` where it has
        one): KV heads default to the query heads, ``head_dim`` to ``hidden_size //
        num_attention_heads``.

        Raises:
            ValueError: a geometry field that is not a positive integer, named.
        """
        text = getattr(config, "text_config", None) or config
        heads = int(text.num_attention_heads)
        if heads < 1:
            raise ValueError(f"DecoderShape num_attention_heads must be a positive integer, "
                             f"got {heads} from the model config")
        return cls(num_attention_heads=heads,
                   num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
                   intermediate_size=int(text.intermediate_size))

    def check(self, tp_size: int) -> None:
        """Raise where vLLM could not split this model over ``tp_size`` workers.

        Raises:
            ValueError: naming the dimension that does not divide.
        """
        if tp_size < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {tp_size}")
        for what, size in (("num_attention_heads", self.num_attention_heads),
                           ("intermediate_size", self.intermediate_size)):
            if size % tp_size:
                raise ValueError(f"{what} {size} does not divide into {tp_size} "
                                 "tensor-parallel ranks")
        kv = self.num_key_value_heads
        if kv % tp_size and tp_size % kv:
            raise ValueError(f"num_key_value_heads {kv} and tensor-parallel size {tp_size}: "
                             "one must divide the other (vLLM splits or replicates KV heads)")


def decoder_tensor_parallel_layout(shapes: Shapes, model: DecoderShape, tp_size: int,
                                   tp_rank: int) -> Layout:
    """What tensor-parallel rank ``tp_rank`` of ``tp_size`` needs of a Qwen2/Llama-family
    checkpoint (Hugging Face names), as vLLM shards it: the vocabulary-parallel embedding
    and ``lm_head`` by rows (the vocabulary padded to a multiple of 64, then split evenly),
    column-parallel ``q/k/v_proj`` and ``gate/up_proj`` (weights and biases) by rows,
    row-parallel ``o_proj`` and ``down_proj`` weights by columns, everything else (norms,
    row-parallel biases) whole. Where ``tp_size`` exceeds the KV heads, each KV head is
    replicated on ``tp_size // num_key_value_heads`` ranks.

    Raises:
        ValueError: a rank outside ``0 .. tp_size - 1``, or a model vLLM cannot split so.
    """
    model.check(tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} is not a rank of {tp_size}")
    query = model.num_attention_heads // tp_size * model.head_dim
    mlp = model.intermediate_size // tp_size
    kv_heads = model.num_key_value_heads
    if tp_size <= kv_heads:
        kv_rows = kv_heads // tp_size * model.head_dim
        kv_start = tp_rank * kv_rows
    else:  # each KV head on tp_size // kv_heads ranks
        kv_rows = model.head_dim
        kv_start = tp_rank // (tp_size // kv_heads) * kv_rows
    boxes: dict[str, Box] = {}
    for name, shape in shapes.items():
        if _VOCAB.search(name):
            padded = -(-shape[0] // _VOCAB_PADDING) * _VOCAB_PADDING
            rows = padded // tp_size
            boxes[name] = Box.along(shape, 0, tp_rank * rows, (tp_rank + 1) * rows)
        elif _QUERY.search(name):
            boxes[name] = Box.along(shape, 0, tp_rank * query, (tp_rank + 1) * query)
        elif _KEY_VALUE.search(name):
            boxes[name] = Box.along(shape, 0, kv_start, kv_start + kv_rows)
        elif _ATTENTION_OUT.search(name):
            boxes[name] = Box.along(shape, 1, tp_rank * query, (tp_rank + 1) * query)
        elif _MLP_IN.search(name):
            boxes[name] = Box.along(shape, 0, tp_rank * mlp, (tp_rank + 1) * mlp)
        elif _MLP_OUT.search(name):
            boxes[name] = Box.along(shape, 1, tp_rank * mlp, (tp_rank + 1) * mlp)
        else:
            boxes[name] = Box.whole(shape)
    return Layout(boxes)
