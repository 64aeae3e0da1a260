"""Packing ``(name, tensor)`` streams into fixed-size byte buckets, and unpacking them.

The sender writes tensors' bytes into two alternating buffers (double buffering) so that
filling one bucket overlaps moving the other. A tensor larger than a bucket is split into
chunks that the receiver merges back. Any dtype, 0-dim, empty and non-contiguous tensors are
accepted; offsets are aligned so received slices can be viewed as their dtype.
"""

from __future__ import annotations

import math
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    ItemsView,
    Iterable,
    Iterator,
    Mapping,
)
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch

from weightsync_core.api.checksums import HostDigest
from weightsync_core.api.engine import WeightsSource
from weightsync_core.api.passes import PassTimes
from weightsync_core.net.blocking import run_blocking

T = TypeVar("T")

__all__ = [
    "ALIGNMENT",
    "OFFLOAD_BYTES",
    "BucketMeta",
    "BucketPacker",
    "BucketUnpacker",
    "PackedBucket",
    "ReceiveBuffers",
    "TensorMeta",
    "WeightsSource",
    "as_bytes",
    "cast_for_rollout",
    "copy_bytes",
    "iter_named_tensors",
    "iter_named_tensors_sync",
    "offloaded",
    "storage_refs",
]

ALIGNMENT = 256
"""Byte alignment of every tensor (and chunk) inside a bucket."""

OFFLOAD_BYTES = 1 << 20
"""Copies and checksums at least this large run on a worker thread, so the event loop can
drive transfers of earlier buckets meanwhile (smaller ones are not worth the hop)."""



@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Where one tensor (or one chunk of a tensor) lies in a bucket.

    Attributes:
        name: the tensor's name.
        shape: the full tensor's shape.
        dtype: the tensor's dtype (after any rollout cast).
        offset: byte offset of this piece in the bucket.
        nbytes: bytes of this piece.
        total_nbytes: bytes of the whole tensor.
        chunk_offset: byte offset of this piece within the whole tensor.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int
    total_nbytes: int
    chunk_offset: int = 0

    @property
    def is_chunk(self) -> bool:
        """True if this piece is only part of its tensor."""
        return self.nbytes != self.total_nbytes


@dataclass(slots=True)
class BucketMeta:
    """Description of one filled bucket, sent alongside (or ahead of) its bytes."""

    index: int
    nbytes: int
    tensors: list[TensorMeta]
    checksum: int | None = None

    def check(self, capacity: int) -> None:
        """Raise :class:`ValueError` unless this description fits a ``capacity``-byte bucket
        and every piece lies inside the bucket and inside its tensor (a receiver checks
        what it was told before slicing its buffer with it)."""
        if not 0 <= self.nbytes <= capacity:
            raise ValueError(
                f"bucket {self.index} claims {self.nbytes} bytes but buckets hold {capacity}; "
                "use the same update_weights_bucket_megabytes on both sides"
            )
        for piece in self.tensors:
            whole = math.prod(piece.shape) * piece.dtype.itemsize
            if (
                min(piece.shape, default=0) < 0 or piece.total_nbytes != whole
                or min(piece.offset, piece.nbytes, piece.chunk_offset) < 0
                or piece.offset + piece.nbytes > self.nbytes
                or piece.chunk_offset + piece.nbytes > piece.total_nbytes
            ):
                raise ValueError(
                    f"bucket {self.index}: the piece of {piece.name!r} (offset {piece.offset}, "
                    f"{piece.nbytes} of {piece.total_nbytes} bytes from byte "
                    f"{piece.chunk_offset}, shape {list(piece.shape)}) does not fit the bucket "
                    "or its tensor"
                )


@dataclass(slots=True)
class PackedBucket:
    """A filled bucket: its buffer and the metadata that describes ``buffer[:meta.nbytes]``.

    ``direct`` buckets are views of a tensor's own memory, not one of the packer's buffers.
    """

    buffer: torch.Tensor
    meta: BucketMeta
    direct: bool = False

    @property
    def data(self) -> torch.Tensor:
        """The used bytes of the buffer."""
        return self.buffer[: self.meta.nbytes]


def _align(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of ``tensor``'s data (copied first only if non-contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def cast_for_rollout(tensor: torch.Tensor, rollout_dtype: torch.dtype | None) -> torch.Tensor:
    """Cast floating-point tensors to ``rollout_dtype``; leave other tensors untouched."""
    if rollout_dtype is not None and tensor.is_floating_point() and tensor.dtype != rollout_dtype:
        return tensor.to(rollout_dtype)
    return tensor


async def iter_named_tensors(
    weights: WeightsSource,
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Iterate ``weights`` (sync/async iterable of pairs, or a mapping) with validation.

    Raises:
        TypeError: an item is not a ``(str, torch.Tensor)`` pair.
        ValueError: a name occurs twice.
    """
    source = _checked_whole(weights)
    seen: set[str] = set()
    if isinstance(source, AsyncIterable):
        async for item in source:
            yield _checked_item(item, seen)
    elif isinstance(source, Iterable):
        for item in source:
            yield _checked_item(item, seen)
    else:
        raise TypeError(
            "weights must be an iterable or async iterable of (name, tensor) pairs or a state "
            f"dict, got {type(weights).__name__}"
        )


def iter_named_tensors_sync(weights: WeightsSource) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`iter_named_tensors` for a consumer that iterates synchronously (engines written
    for verl do on their non-sending ranks).

    Raises:
        TypeError: ``weights`` is only asynchronously iterable, or an item is not a
            ``(str, torch.Tensor)`` pair.
        ValueError: a name occurs twice.
    """
    source = _checked_whole(weights)
    if not isinstance(source, Iterable):
        raise TypeError(
            f"the engine iterates the weights with a plain for loop, but they are a "
            f"{type(weights).__name__}, which only async for can iterate: yield them from a "
            "plain generator (or hand over a state dict)"
        )
    seen: set[str] = set()
    for item in source:
        yield _checked_item(item, seen)


def _checked_whole(weights: WeightsSource) -> object:
    """What to iterate of ``weights``: a state dict's items, or ``weights`` itself. A state
    dict, list or tuple is checked whole first (every item a ``(str, tensor)`` pair, no name
    twice), so that a bad item late in it fails before any byte moves; a generator or other
    stream can only be checked item by item, as it yields (an FSDP actor gathers each full
    tensor only when it yields it: buffering the stream to check it would hold the whole
    model).

    Raises:
        TypeError, ValueError: as :func:`_checked_item`, for a state dict, list or tuple.
    """
    source = weights.items() if isinstance(weights, Mapping) else weights
    if isinstance(source, (list, tuple, ItemsView)):
        seen: set[str] = set()
        for item in source:
            _checked_item(item, seen)
    return source


def _checked_item(item: object, seen: set[str]) -> tuple[str, torch.Tensor]:
    if not (isinstance(item, tuple) and len(item) == 2):
        raise TypeError(f"weights must yield (name, tensor) pairs, got {item!r:.80}")
    name, tensor = item
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be strings, got {name!r} ({type(name).__name__})")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor; only tensors "
            "can be synced"
        )
    if name in seen:
        raise ValueError(f"duplicate tensor name {name!r} in the weights stream; names must be "
                         "unique within one sync")
    seen.add(name)
    return name, tensor


@dataclass
class BucketPacker:
    """Fills alternating buffers with tensors' bytes and yields each full bucket.

    The consumer must be done with a packed bucket before asking for a bucket after the next
    packed one: with two buffers, a packed bucket reuses the buffer of the packed bucket two
    before it. Direct buckets reuse nothing.

    A tensor of at least ``direct_min_bytes`` (on the buffers' device) is not copied: it is
    yielded as bucket(s) of its own whose buffer is the tensor's memory ("direct" buckets,
    split at the bucket size). This saves one copy of most of a model's bytes.

    With ``grow``, nothing is reused: bucket ``i`` goes to ``buffers[i]``, and ``grow()``
    appends a buffer whenever the list is too short (for engines that keep every bucket,
    e.g. as a cache of the latest weights).

    Attributes:
        buffers: two (or more) ``uint8`` buffers of equal size, on the engine's device (with
            ``grow``: the buffers to fill first, possibly none).
        grow: returns one more buffer of the same size, when packing needs one.
        rollout_dtype: cast floating-point tensors to this dtype first.
        checksum: if set, computes each bucket's checksum for verification.
        passes: where the cast, the packing copy and the checksum are timed (``cast``,
            ``pack``, ``sender_checksum``), if given.
        hash_while_packing: with ``checksum``, take the checksum of a packed bucket in
            host memory as its bytes are copied in, in the same pass
            (:class:`~weightsync_core.api.checksums.HostDigest`), instead of ``checksum``:
            only where ``checksum`` is the host's xxh3
            (:meth:`~weightsync_core.api.engine.CheckpointEngine.hashes_on_host`).
        direct_min_bytes: send tensors at least this large without packing (None: never).
        manifest: after packing, ``(name, shape, dtype)`` of every tensor sent.
        nbytes / num_tensors / num_buckets: counters after packing (``nbytes``: the
            tensors' bytes, without the alignment between them).
    """

    buffers: list[torch.Tensor]
    rollout_dtype: torch.dtype | None = None
    checksum: Callable[[torch.Tensor], int] | None = None
    direct_min_bytes: int | None = None
    grow: Callable[[], torch.Tensor] | None = None
    passes: PassTimes | None = None
    hash_while_packing: bool = False
    manifest: list[tuple[str, tuple[int, ...], torch.dtype]] = field(default_factory=list)
    nbytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0

    def __post_init__(self) -> None:
        if self.grow is not None and not self.buffers:
            self.buffers.append(self.grow())
        sizes = {buffer.numel() for buffer in self.buffers}
        if len(sizes) != 1 or min(sizes) < ALIGNMENT:
            raise ValueError(f"buffers must share one size of at least {ALIGNMENT} bytes")
        self.bucket_size = sizes.pop()
        self._packed = 0
        self._digest: HostDigest | None = None
        """The packed bucket's checksum so far (``hash_while_packing``), of its bytes up to
        ``_hashed``."""
        self._hashed = 0

    async def pack(self, weights: WeightsSource) -> AsyncIterator[PackedBucket]:
        """Yield filled buckets for ``weights``; the last one may be partly filled or empty."""
        metas: list[TensorMeta] = []
        offset = end = 0
        async for name, tensor in iter_named_tensors(weights):
            with self._timed("cast"):
                tensor = cast_for_rollout(tensor, self.rollout_dtype)
            data = as_bytes(tensor)
            total = data.numel()
            shape = tuple(tensor.shape)
            self.manifest.append((name, shape, tensor.dtype))
            self.num_tensors += 1
            direct = (
                self.direct_min_bytes is not None
                and total >= self.direct_min_bytes
                and data.device == self.buffers[0].device
            )
            if offset > 0 and (direct or total > self.bucket_size - offset):
                yield await self._flush(metas, end)
                metas, offset, end = [], 0, 0
            if direct:
                for start in range(0, total, self.bucket_size):
                    piece = min(self.bucket_size, total - start)
                    meta = TensorMeta(name, shape, tensor.dtype, 0, piece, total, start)
                    yield await self._bucket(
                        data[start : start + piece], [meta], piece, direct=True
                    )
                continue
            position = 0
            while True:
                piece = min(total - position, self.bucket_size - offset)
                buffer = self._buffer(self._packed)
                with self._timed("pack"):
                    await offloaded(piece, self._copy_in, buffer, offset,
                                     data[position : position + piece])
                metas.append(TensorMeta(name, shape, tensor.dtype, offset, piece, total, position))
                end = offset + piece
                offset = _align(end)
                position += piece
                if position >= total:
                    break
                yield await self._flush(metas, end)
                metas, offset, end = [], 0, 0
        yield await self._flush(metas, end)

    def _copy_in(self, buffer: torch.Tensor, offset: int, piece: torch.Tensor) -> None:
        """Copy ``piece`` into ``buffer`` at ``offset``; hashing while packing, the bytes
        before it (alignment) and the copy go into the bucket's checksum."""
        target = buffer[offset : offset + piece.numel()]
        if not (self.hash_while_packing and self.checksum is not None
                and buffer.device.type == "cpu"):
            target.copy_(piece)
            return
        if self._digest is None:
            self._digest, self._hashed = HostDigest(), 0
        self._digest.feed(buffer[self._hashed : offset])
        if piece.device.type == "cpu":
            self._digest.copy(target, piece)
        else:  # from a device: copied, then hashed
            target.copy_(piece)
            self._digest.feed(target)
        self._hashed = offset + piece.numel()

    def _timed(self, name: str) -> AbstractContextManager[None]:
        """Time pass ``name`` where the packer has ``passes``."""
        return nullcontext() if self.passes is None else self.passes.timed(name)

    def _buffer(self, index: int) -> torch.Tensor:
        if self.grow is None:
            return self.buffers[index % len(self.buffers)]
        while len(self.buffers) <= index:
            self.buffers.append(self.grow())
        return self.buffers[index]

    async def _flush(self, metas: list[TensorMeta], nbytes: int) -> PackedBucket:
        buffer = self._buffer(self._packed)
        self._packed += 1
        digest, self._digest = self._digest, None
        if digest is None:
            return await self._bucket(buffer, metas, nbytes)
        digest.feed(buffer[self._hashed : nbytes])
        return await self._bucket(buffer, metas, nbytes, checksum=digest.value())

    async def _bucket(
        self, buffer: torch.Tensor, metas: list[TensorMeta], nbytes: int, direct: bool = False,
        checksum: int | None = None,
    ) -> PackedBucket:
        """Bucket ``buffer[:nbytes]``, with ``checksum`` where it was taken while packing."""
        meta = BucketMeta(self.num_buckets, nbytes, metas)
        if checksum is not None:
            meta.checksum = checksum
        elif self.checksum is not None:
            with self._timed("sender_checksum"):
                meta.checksum = await offloaded(nbytes, self.checksum, buffer[:nbytes])
        self.num_buckets += 1
        self.nbytes += sum(piece.nbytes for piece in metas)
        return PackedBucket(buffer, meta, direct)


async def copy_bytes(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy ``source`` into ``target`` (``uint8``, same size), on a worker thread when it is
    large enough that the event loop should keep running meanwhile."""
    await offloaded(source.numel(), target.copy_, source)


async def offloaded(nbytes: int, function: Callable[..., T], *args: object) -> T:
    """``function(*args)``, on a worker thread when it touches ``OFFLOAD_BYTES`` or more."""
    if nbytes >= OFFLOAD_BYTES:
        return await run_blocking(function, *args)
    return function(*args)


@dataclass
class _PartialTensor:
    meta: TensorMeta
    data: torch.Tensor
    received: int = 0


class BucketUnpacker:
    """Turns received buckets back into ``(name, tensor)`` pairs, merging chunked tensors.

    Args:
        copy: yield tensors that own their memory (for engines whose receive buffers are
            fixed, e.g. registered with a NIC). Without it, whole tensors are yielded as views
            of the bucket; pair that with :class:`ReceiveBuffers`, which never overwrites a
            bucket that is still viewed. Merged chunks always own their memory.
    """

    def __init__(self, copy: bool = True) -> None:
        self._partial: dict[str, _PartialTensor] = {}
        self._copy = copy

    def unpack(
        self, data: torch.Tensor, meta: BucketMeta
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the complete tensors of one bucket (``data`` is the bucket's used bytes)."""
        for tensor_meta in meta.tensors:
            piece = data[tensor_meta.offset : tensor_meta.offset + tensor_meta.nbytes]
            if not tensor_meta.is_chunk:
                yield tensor_meta.name, _materialize(piece.clone() if self._copy else piece,
                                                     tensor_meta)
                continue
            partial = self._partial.get(tensor_meta.name)
            if partial is None:
                buffer = torch.empty(
                    tensor_meta.total_nbytes, dtype=torch.uint8, device=data.device
                )
                partial = self._partial[tensor_meta.name] = _PartialTensor(tensor_meta, buffer)
            start = tensor_meta.chunk_offset
            partial.data[start : start + tensor_meta.nbytes].copy_(piece)
            partial.received += tensor_meta.nbytes
            if partial.received == tensor_meta.total_nbytes:
                del self._partial[tensor_meta.name]
                yield tensor_meta.name, _materialize(partial.data, tensor_meta)

    def incomplete(self) -> list[str]:
        """Names of chunked tensors that started but never completed."""
        return sorted(self._partial)


@dataclass
class _Kept:
    buffer: torch.Tensor
    baseline: int | None
    """Its storage's reference count right after allocation (None: unknown, never free)."""
    sync: int
    """The sync that last took it."""

    def free(self) -> bool:
        """Whether nothing but the pool views the buffer."""
        refs = storage_refs(self.buffer)
        return refs is not None and refs == self.baseline


class ReceiveBuffers:
    """Bucket buffers for a receiver that yields views of them instead of copies.

    A buffer is written again only when nothing outside the engine views it (its storage's
    reference count is back at its value right after allocation: :func:`storage_refs`), so
    a consumer that keeps received tensors never sees them overwritten. Every buffer it
    allocated is kept for reuse, for any later bucket it fits: a streaming consumer cycles
    through two or three, and a staged sync, whose worker holds a version's buckets until
    the commit after next (as its stage, then as the copy to roll back to), finds them free
    two syncs later, instead of filling fresh memory that the kernel faults in and zeroes
    page by page (0.52-0.57 s per GiB here against 0.13 s into memory used before). A
    buffer still viewed when a sync begins, :data:`KEPT_SYNCS` syncs after the one that
    last took it, belongs to its viewer from then on and is dropped.

    Args:
        allocate: returns one new buffer of the given number of bytes.
    """

    DEFAULT_SLOTS: ClassVar[int] = 3
    """Buffers a streaming consumer keeps in use at once (the host memory an engine
    declares: :meth:`~weightsync_core.api.engine.CheckpointEngine.buckets_in_host_memory`)."""
    KEPT_SYNCS: ClassVar[int] = 2
    """Syncs a buffer may stay viewed and still be kept for reuse."""

    def __init__(self, allocate: Callable[[int], torch.Tensor]) -> None:
        self._allocate = allocate
        self._pool: list[_Kept] = []
        self._sync = 0
        self.allocations = 0

    @property
    def kept_bytes(self) -> int:
        """Bytes of the buffers kept for reuse."""
        return sum(kept.buffer.numel() for kept in self._pool)

    def take(self, index: int, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` to receive bucket ``index`` into: the smallest
        free one that fits, else a new one of ``nbytes``. Bucket 0 begins a sync."""
        if index == 0:
            self._sync += 1
            self._pool = [kept for kept in self._pool
                          if kept.sync >= self._sync - self.KEPT_SYNCS or kept.free()]
        fitting = [kept for kept in self._pool if kept.buffer.numel() >= nbytes and kept.free()]
        if fitting:
            chosen = min(fitting, key=lambda kept: kept.buffer.numel())
        else:
            buffer = self._allocate(nbytes)
            chosen = _Kept(buffer, storage_refs(buffer), self._sync)
            self._pool.append(chosen)
            self.allocations += 1
        chosen.sync = self._sync
        return chosen.buffer


def storage_refs(tensor: torch.Tensor) -> int | None:
    """How many tensors share ``tensor``'s storage (plus a constant); None if unknown.
    Comparing it with the value right after allocation tells whether a consumer still
    holds a view of a receive buffer."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # pragma: no cover - torch without the counter: never reuse
        return None
    return use_count(tensor.untyped_storage()._cdata)


def _materialize(raw: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    if meta.total_nbytes == 0:
        return torch.empty(meta.shape, dtype=meta.dtype, device=raw.device)
    return raw.view(meta.dtype).reshape(meta.shape)
