"""What a checkpoint engine written for verl imports from ``verl.checkpoint_engine.base``,
under the same names, so that it runs on weightsync with only that import line changed::

    -from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry, TensorMeta
    +from weightsync_core.verl_compat import CheckpointEngine, CheckpointEngineRegistry, TensorMeta

Such an engine keeps its own constructor (it need not call ``super().__init__``), may return
nothing from ``send_weights`` (the actor worker counts what it took) and is driven by
weightsync's manager: deadlines, blame, stale replicas, add and remove. The chunk helpers
here split and merge tensors larger than a bucket as verl's do, and also keep empty tensors
and refuse a stream whose chunks do not add up.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from weightsync_core.api.engine import CheckpointEngine, CheckpointEngineWithCache
from weightsync_core.api.registry import CheckpointEngineRegistry as WeightsyncRegistry
from weightsync_core.data.bucketing import WeightsSource, iter_named_tensors

__all__ = [
    "VERL_NAME_PREFIX",
    "CheckpointEngine",
    "CheckpointEngineRegistry",
    "CheckpointEngineWithCache",
    "TensorMeta",
    "merge_weight_chunks",
    "split_weight_chunks",
    "verl_engine_name",
]

logger = logging.getLogger(__name__)

VERL_NAME_PREFIX = "verl_"
"""An engine written for verl and registered as ``X`` is always backend ``verl_X`` too."""

EngineT = TypeVar("EngineT", bound=type[CheckpointEngine])


def verl_engine_name(name: str) -> str:
    """The name that always reaches the engine written for verl registered as ``name``
    (``nixl`` -> ``verl_nixl``; a name with the prefix already is kept)."""
    return name if name.startswith(VERL_NAME_PREFIX) else f"{VERL_NAME_PREFIX}{name}"


class CheckpointEngineRegistry:
    """verl's registry, as engines written for verl use it, over weightsync's.

    ``register(name)`` files the engine as :func:`verl_engine_name` (``verl_<name>``), and
    as ``name`` itself unless a weightsync backend holds that name (registered, or the
    entry point of an installed backend). So verl's engines (``nixl``, ``nccl``,
    ``mooncake``, ``hccl``, ``kimi_ckpt_engine``) import beside weightsync's backends in
    either order: ``nixl`` stays weightsync's when ``weightsync-nixl`` is installed, and
    ``verl_nixl`` is verl's engine whatever is installed. ``get`` and ``new`` are
    weightsync's.
    """

    get = WeightsyncRegistry.get
    new = WeightsyncRegistry.new

    @staticmethod
    def register(name: str) -> Callable[[EngineT], EngineT]:
        """Class decorator: register an engine written for verl (see the class)."""

        def decorator(engine_cls: EngineT) -> EngineT:
            alias = verl_engine_name(name)
            WeightsyncRegistry.register(alias)(engine_cls)
            if alias == name:
                return engine_cls
            if WeightsyncRegistry.holds(name, other_than=engine_cls):
                logger.info("%s.%s registered as %r: %r is weightsync's backend",
                            engine_cls.__module__, engine_cls.__qualname__, alias, name)
            else:
                WeightsyncRegistry.register(name)(engine_cls)
            return engine_cls

        return decorator


@dataclass
class TensorMeta:
    """One chunk of a tensor, with verl's field names.

    Attributes:
        name: the tensor's name.
        shape: the whole tensor's shape.
        dtype: the tensor's dtype.
        chunk_offset: byte offset of this chunk within the whole tensor.
        chunk_size: bytes of this chunk.
        offset: byte offset of this chunk in its bucket (``None`` until placed).
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype
    chunk_offset: int
    chunk_size: int
    offset: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.shape.numel() * self.dtype.itemsize


async def split_weight_chunks(
    weights: WeightsSource, bucket_size: int, meta_only: bool = False
) -> AsyncIterator[tuple[TensorMeta, torch.Tensor | None]]:
    """Yield ``(meta, bytes)`` for every tensor of ``weights``, in chunks of at most
    ``bucket_size`` bytes (``bytes`` is ``None`` with ``meta_only``). An empty tensor is one
    empty chunk, so it reaches the receiver."""
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive number of bytes, got {bucket_size}")
    async for name, tensor in iter_named_tensors(weights):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        offset = 0
        while True:
            size = min(bucket_size, data.numel() - offset)
            meta = TensorMeta(name, torch.Size(tensor.shape), tensor.dtype, offset, size)
            yield meta, None if meta_only else data[offset:offset + size]
            offset += size
            if offset >= data.numel():
                break


async def merge_weight_chunks(
    chunks: AsyncIterable[tuple[TensorMeta, torch.Tensor]], bucket_size: int | None = None
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from the chunks :func:`split_weight_chunks` made: a tensor in
    one chunk is a view of that chunk (a copy where the chunk is misaligned for its dtype);
    a split one is copied into memory of its own. Chunks
    out of order, of another tensor, or a stream that ends inside a tensor raise
    :class:`ValueError`. ``bucket_size`` is accepted for verl's signature and not needed."""
    pending: TensorMeta | None = None
    merged: torch.Tensor | None = None
    filled = 0
    async for meta, chunk in chunks:
        if chunk.dtype != torch.uint8 or chunk.numel() != meta.chunk_size:
            raise ValueError(
                f"chunk of {meta.name!r} must be {meta.chunk_size} uint8 bytes, got "
                f"{chunk.numel()} {chunk.dtype}"
            )
        if pending is None and meta.chunk_offset == 0 and meta.chunk_size == meta.nbytes:
            if chunk.storage_offset() % meta.dtype.itemsize:
                chunk = chunk.clone()  # a view must start at a multiple of its element size
            yield meta.name, chunk.view(meta.dtype).view(meta.shape)
            continue
        if pending is None or merged is None:  # set together: both None between tensors
            pending, filled = meta, 0
            merged = torch.empty(meta.nbytes, dtype=torch.uint8, device=chunk.device)
        if meta.name != pending.name or meta.chunk_offset != filled:
            raise ValueError(
                f"expected {pending.name!r} from byte {filled}, got {meta.name!r} from byte "
                f"{meta.chunk_offset}: chunks arrive in order, one tensor at a time"
            )
        merged[filled:filled + meta.chunk_size] = chunk
        filled += meta.chunk_size
        if filled == pending.nbytes:
            yield pending.name, merged.view(pending.dtype).view(pending.shape)
            pending, merged = None, None
    if pending is not None:
        raise ValueError(
            f"the chunks ended inside {pending.name!r} ({filled} of {pending.nbytes} bytes)"
        )
