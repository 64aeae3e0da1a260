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
LM head, norms, a mixture-of-experts router (``*.mlp.gate.weight``,
``*.mlp.shared_expert_gate.weight``) and a LoRA adapter's matrices (``lora_A``, ``lora_B``).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping, Sequence

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
    "Offsets",
    "QuantizedWeights",
    "block_amax",
    "covered_blocks",
    "dequantize_fp8_block",
    "dequantized",
    "dequantized_stream",
    "quantize_fp8_block",
    "quantized_weight_of",
    "quantizes",
    "scales_of",
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
    r"(^|\.)(embed_tokens|lm_head|[a-z_]*norm[a-z_]*|lora_[AB])\.|"
    r"\.mlp\.(gate|shared_expert_gate)\.weight$")
"""Names whose weights stay unquantized (embeddings, head, norms, a MoE router and a shared
expert's gate, a LoRA adapter's matrices)."""


def quantizes(name: str, tensor: torch.Tensor) -> bool:
    """Whether ``fp8_block`` quantizes the tensor ``name``: a 2-D floating-point
    ``*.weight`` outside embeddings, the LM head, norms, a MoE router's gates and a LoRA
    adapter's ``lora_A``/``lora_B``."""
    return (tensor.dim() == 2 and tensor.is_floating_point()
            and tensor.dtype != torch.float8_e4m3fn and name.endswith(".weight")
            and _UNQUANTIZED.search(name) is None)


def _blocks(rows: int, columns: int) -> tuple[int, int]:
    return -(-rows // QUANTIZED_BLOCK), -(-columns // QUANTIZED_BLOCK)


def covered_blocks(shape: Sequence[int], offset: tuple[int, int] = (0, 0)
                   ) -> tuple[int, int]:
    """How many block rows and block columns a 2-D piece of ``shape`` at ``offset`` (its
    first element's row and column in the whole weight) touches."""
    return _blocks(offset[0] % QUANTIZED_BLOCK + shape[0],
                   offset[1] % QUANTIZED_BLOCK + shape[1])


def scales_of(amax: torch.Tensor) -> torch.Tensor:
    """The scales of blocks whose largest absolute values are ``amax`` (float32), by the
    module's rule: ``max(amax, 1e-4) / 448``."""
    return amax.float().clamp_min(MIN_AMAX).div_(FP8_MAX)


_CHUNK_BYTES = 4 << 20
"""About how many bytes of float32 one step over a weight works on (whole block rows):
small enough to stay in cache, so no pass faults in fresh memory."""


def _block_chunks(piece: torch.Tensor, offset: tuple[int, int]
                  ) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """``piece`` (2-D) a few block rows at a time, in one float32 buffer laid out on the
    block grid of the whole weight (``offset``: the piece's first element there; what the
    covered blocks hold outside the piece reads as 0).

    Yields ``(first, last, block_row, blocks)``: the piece's rows ``first:last`` sit in
    ``blocks`` (``[block rows, 128, block columns, 128]``, the covered block rows from
    ``block_row`` on, counted from the piece's first); the next step reuses the buffer."""
    rows, columns = piece.shape
    top, left = offset[0] % QUANTIZED_BLOCK, offset[1] % QUANTIZED_BLOCK
    row_blocks, column_blocks = covered_blocks((rows, columns), offset)
    padded_columns = column_blocks * QUANTIZED_BLOCK
    step = max(1, _CHUNK_BYTES // (QUANTIZED_BLOCK * padded_columns * 4))
    buffer = torch.zeros((min(step, row_blocks) * QUANTIZED_BLOCK, padded_columns),
                         dtype=torch.float32, device=piece.device)
    for block_row in range(0, row_blocks, step):
        blocks_here = min(step, row_blocks - block_row)
        chunk = buffer[: blocks_here * QUANTIZED_BLOCK]
        first = max(block_row * QUANTIZED_BLOCK - top, 0)
        last = min((block_row + blocks_here) * QUANTIZED_BLOCK - top, rows)
        at = first + top - block_row * QUANTIZED_BLOCK
        chunk[:at].zero_()  # rows of the covered blocks outside the piece count as 0
        chunk[at + last - first:].zero_()
        chunk[at:at + last - first, left:left + columns].copy_(piece[first:last])
        yield first, last, block_row, chunk.view(blocks_here, QUANTIZED_BLOCK,
                                                 column_blocks, QUANTIZED_BLOCK)


def _checked_2d(piece: torch.Tensor) -> None:
    if piece.dim() != 2 or not piece.is_floating_point():
        raise ValueError(f"fp8_block quantizes 2-D floating-point weights, got a "
                         f"{piece.dim()}-D {piece.dtype} tensor")


def block_amax(piece: torch.Tensor, offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """The largest absolute value (float32) of ``piece``'s elements in each block it
    covers (:func:`covered_blocks`) of the whole weight, ``piece`` lying at ``offset``:
    a rank's part of the amax of blocks it shares with other ranks."""
    _checked_2d(piece)
    amax = torch.empty(covered_blocks(piece.shape, offset), dtype=torch.float32,
                       device=piece.device)
    for _, _, block_row, blocks in _block_chunks(piece, offset):
        amax[block_row: block_row + blocks.shape[0]] = blocks.abs().amax(dim=(1, 3))
    return amax


def quantize_fp8_block(weight: torch.Tensor, scales: torch.Tensor | None = None,
                       offset: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (2-D, floating point, any device) as float8_e4m3fn of its shape and the
    float32 scales of the blocks it covers (``[ceil(rows / 128), ceil(columns / 128)]``
    for a whole weight), by the module's rule.

    A piece of a weight (an FSDP rank's rows, a tensor-parallel slice) lies at ``offset``
    of the whole and takes the ``scales`` of the blocks it covers, agreed with the ranks
    holding the rest of those blocks (:func:`scales_of` their :func:`block_amax`); without
    ``scales``, each block's scale comes from ``weight`` alone.

    It works through the weight a few block rows at a time in one float32 buffer, writing
    each step's float8 values straight into the result.

    Raises:
        ValueError: not a 2-D floating-point tensor, or ``scales`` not one per covered block.
    """
    _checked_2d(weight)
    covered = covered_blocks(weight.shape, offset)
    if scales is not None and tuple(scales.shape) != covered:
        raise ValueError(f"a {'x'.join(map(str, weight.shape))} piece at {offset} covers "
                         f"{'x'.join(map(str, covered))} blocks, got "
                         f"{'x'.join(map(str, scales.shape))} scales")
    quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    out = torch.empty(covered, dtype=torch.float32, device=weight.device)
    left = offset[1] % QUANTIZED_BLOCK
    for first, last, block_row, blocks in _block_chunks(weight, offset):
        rows_here = slice(block_row, block_row + blocks.shape[0])
        scale = (scales_of(blocks.abs().amax(dim=(1, 3))) if scales is None
                 else scales[rows_here].to(device=weight.device, dtype=torch.float32))
        out[rows_here] = scale
        blocks.div_(scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
        grid = blocks.view(-1, blocks.shape[2] * QUANTIZED_BLOCK)
        at = first + offset[0] % QUANTIZED_BLOCK - block_row * QUANTIZED_BLOCK
        quantized[first:last].copy_(grid[at:at + last - first, left:left + weight.shape[1]])
    return quantized, out


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                         dtype: torch.dtype = torch.float32,
                         offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``weight`` (float8_e4m3fn, 2-D; a piece at ``offset`` of the whole weight) times
    its block's scale from ``scale_inv`` (one per block it covers), in ``dtype``.

    Raises:
        ValueError: ``scale_inv`` does not have one scale per 128x128 block ``weight``
            covers.
    """
    rows, columns = weight.shape
    covered = covered_blocks((rows, columns), offset)
    if tuple(scale_inv.shape) != covered:
        raise ValueError(f"a {rows}x{columns} fp8_block weight"
                         f"{f' at {offset}' if any(offset) else ''} has "
                         f"{'x'.join(map(str, covered))} block scales, got "
                         f"{'x'.join(map(str, scale_inv.shape))}")
    restored = torch.empty((rows, columns), dtype=dtype, device=weight.device)
    left = offset[1] % QUANTIZED_BLOCK
    for first, last, block_row, blocks in _block_chunks(weight, offset):
        scale = scale_inv[block_row: block_row + blocks.shape[0]].float()
        blocks.mul_(scale[:, None, :, None])
        grid = blocks.view(-1, blocks.shape[2] * QUANTIZED_BLOCK)
        at = first + offset[0] % QUANTIZED_BLOCK - block_row * QUANTIZED_BLOCK
        restored[first:last].copy_(grid[at:at + last - first, left:left + columns])
    return restored


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


Offsets = Mapping[str, tuple[int, int]]
"""Where each received piece of a weight lies in the whole (its first row and column), by
name, for a worker that receives slices (a tensor-parallel rank); a name not in it: whole."""


def _restored(name: str, weight: torch.Tensor, scale_inv: torch.Tensor | None,
              dtype: torch.dtype, offsets: Offsets | None) -> torch.Tensor:
    if scale_inv is None:
        raise ValueError(f"received {name!r} in float8 without its scales "
                         f"{name + SCALE_SUFFIX!r}: send it with rollout_quantization='fp8_block'")
    offset = (0, 0) if offsets is None else offsets.get(name, (0, 0))
    return dequantize_fp8_block(weight, scale_inv, dtype, offset)


def dequantized(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                offsets: Offsets | None = None) -> dict[str, torch.Tensor]:
    """A received version in a replica's compute ``dtype``: each float8 weight (or its
    piece at ``offsets``) times its block scales (``<name>_scale_inv``: those of the blocks
    the piece touches; they leave the mapping), the other tensors as they are.

    Raises:
        ValueError: a float8 weight without its scales, or scales of the wrong shape.
    """
    restored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if quantized_weight_of(name) is not None:
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = _restored(name, tensor, tensors.get(name + SCALE_SUFFIX), dtype, offsets)
        restored[name] = tensor
    return restored


async def dequantized_stream(weights: AsyncIterable[tuple[str, torch.Tensor]],
                             dtype: torch.dtype, offsets: Offsets | None = None
                             ) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """:func:`dequantized` for a stream in the order it travels (each float8 weight, then
    its scales): a float8 weight is held until its scales arrive."""
    held: tuple[str, torch.Tensor] | None = None
    async for name, tensor in weights:
        if held is not None:
            if quantized_weight_of(name) != held[0]:
                _restored(held[0], held[1], None, dtype, offsets)  # raises: no scales came
            yield held[0], _restored(held[0], held[1], tensor, dtype, offsets)
            held = None
        elif tensor.dtype == torch.float8_e4m3fn:
            held = (name, tensor)
        else:
            yield name, tensor
    if held is not None:
        _restored(held[0], held[1], None, dtype, offsets)
