"""Sharded delivery of weights quantized on send (``rollout_quantization="fp8_block"``).

What travels: each quantized weight as float8 and, right after it, its scales
(``<name>_scale_inv``, one float32 per 128x128 block), the other tensors in
``rollout_dtype`` (:func:`travel_weights`).

Who holds which scales, who needs which (:func:`with_scale_boxes`): an actor rank holds the
scales of the blocks whose first element lies in its box of the weight (so every block has
one holder, whatever the rows of each rank); a rollout worker needs the scales of every
block its box touches (a tensor-parallel slice that cuts a block gets that block's scale;
vLLM itself takes only slices aligned to blocks).

One scale per block, whichever ranks hold its rows (:class:`ShardQuantizer`): before an actor
rank quantizes its rows of a weight, the ranks agree each block's largest absolute value
(each sends actor rank 0 its part, sealed under the sync's key; rank 0 sends back the
maximum), so the float8 bytes and scales are exactly those of the whole weight quantized
at once.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping

import torch

from weightsync_core.api.errors import TransferError, UnauthenticatedMessageError
from weightsync_core.api.passes import PassTimes
from weightsync_core.data.bucketing import cast_for_rollout
from weightsync_core.data.quantization import (
    FP8_BLOCK,
    QUANTIZED_BLOCK,
    SCALE_SUFFIX,
    block_amax,
    quantize_fp8_block,
    quantized_weight_of,
    quantizes,
    scales_of,
)
from weightsync_core.data.shards.box import Box
from weightsync_core.data.shards.exchange import PlanExchange
from weightsync_core.data.shards.layout import Layout, Shapes
from weightsync_core.net.wire import MessageSealer

__all__ = ["ShardQuantizer", "amax_frame_bytes", "open_amax", "scale_tensors", "seal_amax",
           "travel_weights", "with_scale_boxes"]

_HEADER = struct.Struct("<16sQII")
"""The plan's digest, the quantized tensor's index, the sending and the receiving actor rank
(a sealed frame replayed to another rank, the other way or for another tensor is refused)."""


def travel_weights(shapes: Shapes, dtypes: Mapping[str, torch.dtype],
                   rollout_dtype: torch.dtype | None, quantization: str | None
                   ) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype]]:
    """Every tensor's shape and dtype as it travels, in stream order: cast to
    ``rollout_dtype`` (where set), or with ``quantization`` (``"fp8_block"``) each weight
    :func:`~weightsync_core.data.quantization.quantizes` takes as float8 followed by its
    scales.

    Raises:
        ValueError: a quantization format other than ``"fp8_block"``.
    """
    if quantization not in (None, FP8_BLOCK):
        raise ValueError(f"rollout_quantization {quantization!r} is not known; use "
                         f"{FP8_BLOCK!r} or None")
    travel_shapes: dict[str, tuple[int, ...]] = {}
    travel_dtypes: dict[str, torch.dtype] = {}
    for name, shape in shapes.items():
        example = torch.empty((0,) * len(shape), dtype=dtypes[name])
        travel_shapes[name] = tuple(shape)
        if quantization is None or not quantizes(name, example):
            travel_dtypes[name] = cast_for_rollout(example, rollout_dtype).dtype
            continue
        travel_dtypes[name] = torch.float8_e4m3fn
        scales = name + SCALE_SUFFIX
        travel_shapes[scales] = tuple(-(-size // QUANTIZED_BLOCK) for size in shape)
        travel_dtypes[scales] = torch.float32
    return travel_shapes, travel_dtypes


def scale_tensors(shapes: Shapes) -> dict[str, str]:
    """The scale tensors among ``shapes``: ``{scales' name: its weight's name}``."""
    return {name: weight for name in shapes
            if (weight := quantized_weight_of(name)) is not None and weight in shapes}


def _scale_range(start: int, stop: int, holds: bool) -> tuple[int, int]:
    """The block indices (along one dimension) of a box's ``start:stop``: those whose
    first index lies in it (``holds``), or those it touches."""
    if holds:
        return -(-start // QUANTIZED_BLOCK), -(-stop // QUANTIZED_BLOCK)
    if start == stop:
        return start // QUANTIZED_BLOCK, start // QUANTIZED_BLOCK
    return start // QUANTIZED_BLOCK, -(-stop // QUANTIZED_BLOCK)


def scale_box(box: Box, holds: bool) -> Box:
    """The box of a weight's scales that goes with ``box`` of the weight: the blocks whose
    first element it holds (``holds``: an actor rank) or every block it touches (a worker)."""
    return Box(tuple(_scale_range(start, stop, holds) for start, stop in box.ranges))


def with_scale_boxes(layout: Layout, shapes: Shapes, holds: bool) -> Layout:
    """``layout`` (resolved against the weights without their scales) with a box of each
    scale tensor of ``shapes`` where it has one of the weight (:func:`scale_box`)."""
    boxes = dict(layout.boxes)
    replicated, empty = set(layout.replicated), set(layout.empty_by_design)
    for scales, weight in scale_tensors(shapes).items():
        box = layout.boxes.get(weight)
        if box is None or scales in boxes:  # (a spec of boxes may name the scales' own)
            continue
        boxes[scales] = scale_box(box, holds)
        if weight in layout.replicated:
            replicated.add(scales)
        if weight in layout.empty_by_design or not boxes[scales].numel:
            empty.add(scales)
    ordered = {name: boxes[name] for name in shapes if name in boxes}
    return Layout(ordered, frozenset(replicated), frozenset(empty))


class ShardQuantizer:
    """One actor rank's quantizing of its shards in one sync of ``exchange``: for each
    shard in stream order, :meth:`convert` gives what this rank sends of it; then
    :meth:`finish`. In a sync that is not quantized, it casts each shard to the rollout
    dtype and nothing else.

    Each quantized weight costs one exchange among the actor ranks (none with one rank),
    whether or not a rank holds rows of it: every rank sends actor rank 0 its part of the
    weight's block amax (4 bytes a block, sealed), rank 0 sends every rank the maximum; a
    rank that does not answer within the exchange's timeout fails the sync, named, at stage
    ``agreeing scales``. The seconds go to ``passes``: ``amax`` (this rank's part of
    the block amax), ``agree_scales`` (the exchange) and ``quantize``.

    Args:
        exchange: the sync's exchange (its group, tensors as they travel, actor ranks, sealer
            and timeout).
        rank: this actor rank.
        held: this rank's layout, with its scale boxes (:func:`with_scale_boxes`).
        rollout_dtype: what the tensors left unquantized are cast to (None: as they are).
        passes: where the seconds of each pass are counted (the engine's).
    """

    def __init__(self, exchange: PlanExchange, rank: int, held: Layout,
                 rollout_dtype: torch.dtype | None, passes: PassTimes) -> None:
        self.exchange = exchange
        self.rank = rank
        self.held = held
        self.rollout_dtype = rollout_dtype
        self.passes = passes
        self.scales = {weight: scales
                       for scales, weight in scale_tensors(exchange.shapes).items()}
        """Each quantized weight's scale tensor, in stream order."""
        self._weights = list(self.scales)
        self._order = {weight: index for index, weight in enumerate(self._weights)}
        self._agreed_up_to = 0

    def convert(self, name: str, shard: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """What this rank sends of its ``shard`` of tensor ``name``: the float8 shard then
        its box of the scales (a quantized weight), else the shard cast to the rollout
        dtype."""
        scales_name = self.scales.get(name)
        if scales_name is None:
            yield name, cast_for_rollout(shard, self.rollout_dtype)
            return
        index = self._order[name]
        self._agree_absent(index)
        box = self.held.boxes[name]
        offset = (box.ranges[0][0], box.ranges[1][0])
        touched = scale_box(box, holds=False)
        part = torch.zeros(self.exchange.shapes[scales_name], dtype=torch.float32)
        if shard.numel():
            with self.passes.timed("amax"):
                touched.cut(part).copy_(block_amax(shard, offset))
        with self.passes.timed("agree_scales"):
            scales = scales_of(self._agreed(index, part))
        self._agreed_up_to = index + 1
        if shard.numel():
            with self.passes.timed("quantize"):
                quantized, _ = quantize_fp8_block(shard, touched.cut(scales), offset)
        else:
            quantized = torch.empty(shard.shape, dtype=torch.float8_e4m3fn)
        yield name, quantized
        yield scales_name, self.held.boxes[scales_name].cut(scales).contiguous()

    def finish(self) -> None:
        """Every shard was converted: take part in the agreements of the quantized weights
        this rank holds none of that are left."""
        self._agree_absent(len(self._order))

    def _agree_absent(self, index: int) -> None:
        """Take part, with nothing, in the agreements before the ``index``-th quantized
        weight that this rank's stream passed over (it holds none of those weights)."""
        for absent in range(self._agreed_up_to, index):
            with self.passes.timed("agree_scales"):
                self._agreed(absent, torch.zeros(
                    self.exchange.shapes[self.scales[self._weights[absent]]],
                    dtype=torch.float32))
        self._agreed_up_to = max(self._agreed_up_to, index)

    def _agreed(self, index: int, part: torch.Tensor) -> torch.Tensor:
        """The maximum of every actor rank's ``part`` (the block amax of the ``index``-th
        quantized weight), agreed through actor rank 0."""
        exchange = self.exchange
        if exchange.actor_ranks == 1:
            return part
        tag = exchange.free_tag + 2 + 2 * index  # past the carrier's own two
        if self.rank != 0:
            self._send(part, 0, tag, index)
            return self._receive(part, 0, tag + 1, index)
        agreed = part.clone()
        for other in range(1, exchange.actor_ranks):
            torch.maximum(agreed, self._receive(part, other, tag, index), out=agreed)
        for other in range(1, exchange.actor_ranks):
            self._send(agreed, other, tag + 1, index)
        return agreed

    def _send(self, amax: torch.Tensor, rank: int, tag: int, index: int) -> None:
        exchange = self.exchange
        frame = torch.frombuffer(bytearray(seal_amax(
            exchange.sealer, exchange.plan.digest, index, self.rank, rank, amax)),
            dtype=torch.uint8)
        peer = f"actor rank {rank}"
        exchange.wait(exchange.post(exchange.group.send, frame, rank, tag, peer,
                                    "agreeing scales"), peer, "agreeing scales")

    def _receive(self, like: torch.Tensor, rank: int, tag: int, index: int) -> torch.Tensor:
        exchange = self.exchange
        peer = f"actor rank {rank}"
        frame = torch.empty(amax_frame_bytes(exchange.sealer, like.numel()), dtype=torch.uint8)
        exchange.wait(exchange.post(exchange.group.recv, frame, rank, tag, peer,
                                    "agreeing scales"), peer, "agreeing scales")
        return open_amax(exchange.sealer, frame.numpy().tobytes(), exchange.plan.digest, index,
                         rank, self.rank, like.shape)


def amax_frame_bytes(sealer: MessageSealer, blocks: int) -> int:
    """Bytes of a sealed frame of ``blocks`` block amax (:func:`seal_amax`)."""
    return len(sealer.seal(b"")) + _HEADER.size + 4 * blocks


def seal_amax(sealer: MessageSealer, plan: str, index: int, sender: int, receiver: int,
              amax: torch.Tensor) -> bytes:
    """Actor rank ``sender``'s frame to ``receiver`` of the block amax of the ``index``-th
    quantized weight of the sync of ``plan`` (its digest), sealed by ``sealer``."""
    body = _HEADER.pack(bytes.fromhex(plan), index, sender, receiver)
    return sealer.seal(body + amax.float().contiguous().numpy().tobytes())


def open_amax(sealer: MessageSealer, frame: bytes, plan: str, index: int, sender: int,
              receiver: int, shape: torch.Size) -> torch.Tensor:
    """The block amax (``shape``, float32) that :func:`seal_amax` sealed in ``frame``.

    Raises:
        TransferError: naming ``sender``, a frame not sealed under this sync's key, or one
            of another plan, another weight or another pair of ranks (a replay).
    """
    peer = f"actor rank {sender}"
    try:
        body = sealer.open(frame)
    except UnauthenticatedMessageError:
        raise TransferError(f"actor rank {receiver}: the block amax from {peer} was not "
                            "sealed under this sync's key", peer=peer,
                            stage="agreeing scales") from None
    if len(body) != _HEADER.size + 4 * shape.numel() or (
            _HEADER.unpack_from(body) != (bytes.fromhex(plan), index, sender, receiver)):
        raise TransferError(f"actor rank {receiver}: the block amax from {peer} is another "
                            "tensor's, another plan's or another pair of ranks'", peer=peer,
                            stage="agreeing scales")
    return torch.frombuffer(bytearray(body[_HEADER.size:]), dtype=torch.float32).view(shape)
