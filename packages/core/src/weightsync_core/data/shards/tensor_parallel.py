"""What a tensor-parallel rollout worker of a Qwen2/Llama-family model needs, as vLLM shards
it: column-parallel layers by rows, row-parallel layers by columns, the rest whole."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from weightsync_core.data.shards.box import Box
from weightsync_core.data.shards.layout import Layout, Shapes

__all__ = ["DecoderShape", "SplitSize", "decoder_tensor_parallel_layout", "misfit",
           "refuse_misfits"]

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
        vocab_size: the vocabulary's rows (the embedding's and ``lm_head``'s), where known:
            a layout then refuses a checkpoint of another vocabulary (None: not checked).

    Raises:
        ValueError: a field that is not a positive integer, named.
    """

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "vocab_size":
                continue
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
        num_attention_heads``; ``vocab_size`` where the config states it.

        Raises:
            ValueError: a geometry field that is not a positive integer, named.
        """
        text = getattr(config, "text_config", None) or config
        heads = int(text.num_attention_heads)
        if heads < 1:
            raise ValueError(f"DecoderShape num_attention_heads must be a positive integer, "
                             f"got {heads} from the model config")
        vocab = getattr(text, "vocab_size", None)
        return cls(num_attention_heads=heads,
                   num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
                   intermediate_size=int(text.intermediate_size),
                   vocab_size=None if vocab is None else int(vocab))

    def as_fields(self) -> dict[str, int]:
        """The fields as plain data (those not given, None, left out)."""
        return {field.name: value for field in fields(self)
                if (value := getattr(self, field.name)) is not None}

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

    Every tensor it splits must have exactly the size ``model`` gives the split dimension
    (``q_proj`` rows and ``o_proj`` columns: heads x ``head_dim``; ``k/v_proj`` rows: KV
    heads x ``head_dim``; ``gate/up_proj`` rows and ``down_proj`` columns:
    ``intermediate_size``; the vocabulary's rows: ``vocab_size``, where given): a geometry
    that is not the checkpoint's would cut slices vLLM does not hold, clip some to nothing
    and leave rows to no worker. The only empty boxes are a rank's share of vLLM's
    vocabulary padding past the last row (:attr:`Layout.empty_by_design`).

    Raises:
        ValueError: a rank outside ``0 .. tp_size - 1``, a model vLLM cannot split so, or a
            tensor whose shape this geometry does not fit (naming the tensor, its shape,
            the geometry's size and the fix).
    """
    model.check(tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} is not a rank of {tp_size}")
    heads, kv_heads, head_dim = (model.num_attention_heads, model.num_key_value_heads,
                                 model.head_dim)
    query = heads // tp_size * head_dim
    mlp = model.intermediate_size // tp_size
    if tp_size <= kv_heads:
        kv_rows = kv_heads // tp_size * head_dim
        kv_start = tp_rank * kv_rows
    else:  # each KV head on tp_size // kv_heads ranks
        kv_rows = head_dim
        kv_start = tp_rank // (tp_size // kv_heads) * kv_rows
    attention = SplitSize(heads * head_dim,
                       f"num_attention_heads x head_dim = {heads} x {head_dim}", heads,
                       f"with num_attention_heads {heads}, head_dim")
    kv = SplitSize(kv_heads * head_dim, f"num_key_value_heads x head_dim = {kv_heads} x "
                f"{head_dim}", head_dim, f"with head_dim {head_dim}, num_key_value_heads")
    width = SplitSize(model.intermediate_size, "intermediate_size", 1, "intermediate_size")
    vocab = None if model.vocab_size is None else SplitSize(model.vocab_size, "vocab_size", 1,
                                                         "vocab_size")
    boxes: dict[str, Box] = {}
    empty: set[str] = set()
    misfits: list[str] = []
    for name, shape in shapes.items():
        if _VOCAB.search(name):
            misfits += misfit(name, shape, 0, vocab)
            if misfits:
                continue
            padded = -(-shape[0] // _VOCAB_PADDING) * _VOCAB_PADDING
            rows = padded // tp_size
            boxes[name] = Box.along(shape, 0, tp_rank * rows, (tp_rank + 1) * rows)
            if not boxes[name].numel:  # this rank's rows are all vLLM's padding
                empty.add(name)
            continue
        for pattern, dim, split, start, stop in (
                (_QUERY, 0, attention, tp_rank * query, (tp_rank + 1) * query),
                (_KEY_VALUE, 0, kv, kv_start, kv_start + kv_rows),
                (_ATTENTION_OUT, 1, attention, tp_rank * query, (tp_rank + 1) * query),
                (_MLP_IN, 0, width, tp_rank * mlp, (tp_rank + 1) * mlp),
                (_MLP_OUT, 1, width, tp_rank * mlp, (tp_rank + 1) * mlp)):
            if pattern.search(name):
                misfits += misfit(name, shape, dim, split)
                if not misfits:
                    boxes[name] = Box.along(shape, dim, start, stop)
                break
        else:
            boxes[name] = Box.whole(shape)
    refuse_misfits(misfits, "DecoderShape")
    return Layout(boxes, empty_by_design=frozenset(empty))


def refuse_misfits(misfits: Sequence[str], geometry: str) -> None:
    """Raise where a layout found tensors its geometry does not fit (``misfits``: what
    :func:`misfit` said of each), naming the first and the fix (``geometry``: the class
    whose ``from_hf_config`` gives the checkpoint's geometry).

    Raises:
        ValueError: where ``misfits`` is not empty.
    """
    if not misfits:
        return
    more = (f" ({len(misfits)} tensors of the weights do not fit it, the first named)"
            if len(misfits) > 1 else "")
    raise ValueError(
        f"{misfits[0]}{more}: the geometry declared for this tensor-parallel worker is "
        "not that of the checkpoint the actor streams, so its slices would "
        "not be the rows vLLM holds and some rows would reach no worker; declare the "
        f"checkpoint's geometry ({geometry}.from_hf_config of the config the actor's "
        "weights were built from), or load the actor's model on this worker")


@dataclass(frozen=True)
class SplitSize:
    """The size a geometry gives a split dimension, how it was computed, and how to say
    which value would fit a tensor's own size (``unit``: the size one more of the field in
    ``fits`` adds)."""

    size: int
    formula: str
    unit: int
    fits: str


def misfit(name: str, shape: Sequence[int], dim: int, split: SplitSize | None) -> list[str]:
    """``[what is wrong]`` where ``shape``'s dimension ``dim`` is not ``split``'s size (no
    ``split``: nothing to check but the dimension), else ``[]``."""
    side = ("rows" if dim == 0 else "columns") if len(shape) <= 2 else (
        {1: "rows", 2: "columns"}.get(dim, "experts"))  # a fused [experts, rows, columns]
    if len(shape) <= dim:
        return [f"tensor {name!r} has shape {list(shape)}, but a tensor-parallel layout "
                f"splits its {side} (dimension {dim})"]
    if split is None or shape[dim] == split.size:
        return []
    fits = (f" ({split.fits} {shape[dim] // split.unit} would fit it)"
            if shape[dim] % split.unit == 0 else "")
    return [f"tensor {name!r} has shape {list(shape)}, {shape[dim]} {side}, but the declared "
            f"geometry gives it {split.formula} = {split.size}{fits}"]
