"""Quantize on send: block-scaled FP8 as DeepSeek-V3 and Qwen3-FP8 checkpoints store it.

``rollout_quantization="fp8_block"`` sends each linear layer's 2-D weight as
``float8_e4m3fn`` of its shape plus, right after it, a float32 ``<name>_scale_inv`` with one
scale per 128x128 block (``weight_block_size: [128, 128]`` in the checkpoint's
``quantization_config``; a partial block at the end of a row or column has a scale of its
own), which is what vLLM loads for such a checkpoint.

The rule, deterministic on any device: per block, ``amax`` is the largest absolute value
(in float32) and ``scale = max(amax, 1e-4) / 448`` (448 is float8_e4m3fn's largest value;
the floor, as vLLM's and SGLang's block quantizers have it, keeps an all-zero block finite);
each element is ``x / scale`` in float32, clamped to [-448, 448], rounded to the nearest
float8_e4m3fn value (ties to even). Dequantized: ``fp8 * scale``.

Left unquantized (as those checkpoints leave them; they travel in ``rollout_dtype``): every
tensor that is not a 2-D floating-point ``*.weight``, the embeddings (``embed_tokens``), the
LM head, norms, and a mixture-of-experts router (``*.mlp.gate.weight``,
``*.mlp.shared_expert_gate.weight``).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping

import torch

from weightsync_core.api.engine import WeightsSource
from weightsync_core.data.bucketing import (
    cast_for_rollout,
    iter_named_tensors,
    iter_named_tensors_sync,
)

__all__ = [
    "FP8_BLOCK",
    "FP8_MAX",
    "QUANTIZED_BLOCK",
    "SCALE_SUFFIX",
    "QuantizedWeights",
    "dequantize_fp8_block",
    "dequantized",
    "dequantized_stream",
    "quantize_fp8_block",
    "quantized_weight_of",
    "quantizes",
]

FP8_BLOCK = "fp8_block"
"""Block-scaled float8_e4m3fn weights with float32 ``weight_scale_inv`` per 128x128 block."""
QUANTIZED_BLOCK = 128
"""Rows and columns of a block that shares one scale."""
FP8_MAX = 448.0
"""float8_e4m3fn's largest finite value."""
MIN_AMAX = 1e-4
"""The smallest block maximum a scale is made from (an all-zero block stays finite)."""
SCALE_SUFFIX = "_scale_inv"
"""Appended to a quantized weight's name to name its scales (``...weight_scale_inv``)."""
_UNQUANTIZED = re.compile(
    r"(^|\.)(embed_tokens|lm_head|[a-z_]*norm[a-z_]*)\.|\.mlp\.(gate|shared_expert_gate)\.weight$")
"""Names whose weights stay unquantized (embeddings, head, norms, a MoE router and a shared
expert's gate)."""


def quantizes(name: str, tensor: torch.Tensor) -> bool:
    """Whether ``fp8_block`` quantizes the tensor ``name``: a 2-D floating-point
    ``*.weight`` outside embeddings, the LM head, norms and a MoE router's gates."""
    return (tensor.dim() == 2 and tensor.is_floating_point()
            and tensor.dtype != torch.float8_e4m3fn and name.endswith(".weight")
            and _UNQUANTIZED.search(name) is None)


def _blocks(rows: int, columns: int) -> tuple[int, int]:
    return -(-rows // QUANTIZED_BLOCK), -(-columns // QUANTIZED_BLOCK)


def _padded(tensor: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``tensor`` (2-D) padded with ``fill`` up to whole blocks, viewed as
    ``[row blocks, 128, column blocks, 128]``."""
    rows, columns = tensor.shape
    row_blocks, column_blocks = _blocks(rows, columns)
    padded = tensor.new_full((row_blocks * QUANTIZED_BLOCK, column_blocks * QUANTIZED_BLOCK),
                             fill)
    padded[:rows, :columns] = tensor
    return padded.view(row_blocks, QUANTIZED_BLOCK, column_blocks, QUANTIZED_BLOCK)


_CHUNK_BYTES = 4 << 20
"""About how many bytes of float32 one step of :func:`quantize_fp8_block` works on (whole
block rows): small enough to stay in cache, so no pass faults in fresh memory."""


def quantize_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (2-D, floating point, any device) as float8_e4m3fn of its shape and its
    float32 scales ``[ceil(rows / 128), ceil(columns / 128)]``, by the module's rule.

    It works through the weight a few block rows at a time in one float32 buffer, writing
    each step's float8 values straight into the result."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"fp8_block quantizes 2-D floating-point weights, got a "
                         f"{weight.dim()}-D {weight.dtype} tensor")
    rows, columns = weight.shape
    row_blocks, column_blocks = _blocks(rows, columns)
    padded_columns = column_blocks * QUANTIZED_BLOCK
    quantized = torch.empty((rows, columns), dtype=torch.float8_e4m3fn, device=weight.device)
    scales = torch.empty((row_blocks, column_blocks), dtype=torch.float32,
                         device=weight.device)
    step = QUANTIZED_BLOCK * max(1, _CHUNK_BYTES // (QUANTIZED_BLOCK * padded_columns * 4))
    buffer = torch.zeros((min(step, row_blocks * QUANTIZED_BLOCK), padded_columns),
                         dtype=torch.float32, device=weight.device)
    for first in range(0, rows, step):
        last = min(first + step, rows)
        count = last - first
        blocks_here = -(-count // QUANTIZED_BLOCK)
        chunk = buffer[: blocks_here * QUANTIZED_BLOCK]
        chunk[:count, :columns].copy_(weight[first:last])
        chunk[count:].zero_()  # a partial last block row: rows past the weight count as 0
        blocks = chunk.view(blocks_here, QUANTIZED_BLOCK, column_blocks, QUANTIZED_BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)).clamp_min_(MIN_AMAX).div_(FP8_MAX)
        scales[first // QUANTIZED_BLOCK: first // QUANTIZED_BLOCK + blocks_here] = scale
        blocks.div_(scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
        quantized[first:last].copy_(chunk[:count, :columns])
    return quantized, scales


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight`` (float8_e4m3fn, 2-D) times its block's scale from ``scale_inv``, in
    ``dtype``.

    Raises:
        ValueError: ``scale_inv`` does not have one scale per 128x128 block of ``weight``.
    """
    rows, columns = weight.shape
    if tuple(scale_inv.shape) != _blocks(rows, columns):
        raise ValueError(f"a {rows}x{columns} fp8_block weight has "
                         f"{'x'.join(map(str, _blocks(rows, columns)))} block scales, got "
                         f"{'x'.join(map(str, scale_inv.shape))}")
    blocks = _padded(weight.float())
    values = blocks * scale_inv.float()[:, None, :, None]
    return values.view(blocks.shape[0] * QUANTIZED_BLOCK, -1)[:rows, :columns].to(dtype)


class QuantizedWeights:
    """A weight stream as it travels under ``rollout_quantization="fp8_block"``: each weight
    :func:`quantizes` takes becomes its float8 tensor and, right after it, its scales; every
    other tensor is cast to ``rollout_dtype`` (where set). Iterate it with ``async for`` or
    a plain ``for``, as the stream it wraps allows; once."""

    def __init__(self, weights: WeightsSource, rollout_dtype: torch.dtype | None) -> None:
        self.weights = weights
        self.rollout_dtype = rollout_dtype

    def _converted(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if not quantizes(name, tensor):
            yield name, cast_for_rollout(tensor, self.rollout_dtype)
            return
        quantized, scale_inv = quantize_fp8_block(tensor)
        yield name, quantized
        yield name + SCALE_SUFFIX, scale_inv

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iter_named_tensors_sync(self.weights):
            yield from self._converted(name, tensor)

    async def __aiter__(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        async for name, tensor in iter_named_tensors(self.weights):
            for pair in self._converted(name, tensor):
                yield pair


def quantized_weight_of(name: str) -> str | None:
    """The weight whose scales the tensor ``name`` holds (``x.weight`` for
    ``x.weight_scale_inv``), or None: not a scale tensor."""
    return name.removesuffix(SCALE_SUFFIX) if name.endswith(SCALE_SUFFIX) else None


def _restored(name: str, weight: torch.Tensor, scale_inv: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    if scale_inv is None:
        raise ValueError(f"received {name!r} in float8 without its scales "
                         f"{name + SCALE_SUFFIX!r}: send it with rollout_quantization='fp8_block'")
    return dequantize_fp8_block(weight, scale_inv, dtype)


def dequantized(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype
                ) -> dict[str, torch.Tensor]:
    """A received version in a replica's compute ``dtype``: each float8 weight times its
    block scales (``<name>_scale_inv``, which leave the mapping), the other tensors as they
    are.

    Raises:
        ValueError: a float8 weight without its scales, or scales of the wrong shape.
    """
    restored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if quantized_weight_of(name) is not None:
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = _restored(name, tensor, tensors.get(name + SCALE_SUFFIX), dtype)
        restored[name] = tensor
    return restored


async def dequantized_stream(weights: AsyncIterable[tuple[str, torch.Tensor]],
                             dtype: torch.dtype) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """:func:`dequantized` for a stream in the order it travels (each float8 weight, then
    its scales): a float8 weight is held until its scales arrive."""
    held: tuple[str, torch.Tensor] | None = None
    async for name, tensor in weights:
        if held is not None:
            if quantized_weight_of(name) != held[0]:
                _restored(held[0], held[1], None, dtype)  # raises: no scales came
            yield held[0], _restored(held[0], held[1], tensor, dtype)
            held = None
        elif tensor.dtype == torch.float8_e4m3fn:
            held = (name, tensor)
        else:
            yield name, tensor
    if held is not None:
        _restored(held[0], held[1], None, dtype)
