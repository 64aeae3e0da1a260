"""One tensor's delta: what differs bitwise from the receiver's copy, as one ``uint8`` tensor.

A patch is a 32-byte header and a payload, each section padded to 8 bytes:

- ``UNCHANGED``: no payload (the tensor is bitwise what the receiver holds);
- ``POSITIONS``: the changed elements' flat positions (int32, or int64 past 2**31 elements),
  then their new values;
- ``BITMASK``: one bit per element (set where it changed), then the new values;
- ``WHOLE``: the whole new tensor (where a delta would be larger).

The encoder picks the smallest of the four for each tensor. Elements are compared as
integers of their width (``float`` NaNs and ``-0.0`` compare by their bits). The header
carries the digest of the *whole* new tensor, which the receiver checks after applying the
patch to its copy: a receiver whose copy differs from the sender's fails, whatever the patch
touched.
"""

from __future__ import annotations

import enum
import functools
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from weightsync_core.api.checksums import device_checksum, host_checksum
from weightsync_core.data.bucketing import as_bytes
from weightsync_core.data.delta.kernels import diff_gather, scatter_checked

__all__ = [
    "PATCH_HEADER_BYTES",
    "PatchDigestError",
    "PatchKind",
    "PatchStats",
    "apply_patch",
    "build_patch",
    "cheapest_kind",
    "diff_into",
    "encode_patch",
    "flat_words",
    "patch_payload_bytes",
    "tensor_digest",
]

_MAGIC = b"WSD1"
_HEADER = struct.Struct("<4sBBxxQQQ")  # magic, kind, digest kind, numel, changed, digest
PATCH_HEADER_BYTES = _HEADER.size
_SECTION_ALIGNMENT = 8
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


class PatchKind(enum.IntEnum):
    """How a patch encodes the changed elements."""

    UNCHANGED = 0
    POSITIONS = 1
    BITMASK = 2
    WHOLE = 3


class _DigestKind(enum.IntEnum):
    XXH3 = 0  # host tensors
    DEVICE_SUM = 1  # device tensors: computed where they live


@dataclass(frozen=True)
class PatchStats:
    """What one patch holds: ``changed`` of ``numel`` elements, ``nbytes`` on the wire."""

    kind: PatchKind
    numel: int
    changed: int
    nbytes: int


def flat_words(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of a contiguous ``tensor``'s elements as integers of their width (bytes
    for widths without an integer type)."""
    flat = tensor.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    word = _WORDS.get(flat.element_size())
    return flat.view(word) if word is not None else flat.view(torch.uint8)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _SECTION_ALIGNMENT) * _SECTION_ALIGNMENT


def tensor_digest(tensor: torch.Tensor, kind: int | None = None) -> tuple[int, int]:
    """``(digest kind, digest)`` of a tensor's bytes: xxh3 on the host, a position-weighted
    sum on a device (no copy back); ``kind`` forces one (a receiver checks with the
    sender's)."""
    data = as_bytes(tensor)
    if kind is None:
        kind = _DigestKind.XXH3 if data.device.type == "cpu" else _DigestKind.DEVICE_SUM
    if kind == _DigestKind.XXH3:
        return kind, host_checksum(data)
    if kind == _DigestKind.DEVICE_SUM:
        return kind, device_checksum(data) & (2**64 - 1)
    raise ValueError(f"unknown digest kind {kind}")


def _section(payload: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``payload`` padded to the section alignment."""
    padding = _padded(nbytes) - nbytes
    if not padding:
        return payload
    return torch.cat([payload, payload.new_zeros(padding)])


def _header(kind: PatchKind, digest: tuple[int, int], numel: int, changed: int,
            device: torch.device) -> torch.Tensor:
    raw = _HEADER.pack(_MAGIC, kind, digest[0], numel, changed, digest[1])
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def encode_patch(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, PatchStats]:
    """The patch that turns ``old`` into ``new`` (same shape and dtype), and what it holds.
    ``old`` is then updated to equal ``new`` (only the changed elements are written), so
    that it is the baseline of the next patch.

    Raises:
        ValueError: the shapes or dtypes differ.
    """
    if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(f"a patch needs the same shape and dtype: new {list(new.shape)} "
                         f"{new.dtype}, baseline {list(old.shape)} {old.dtype}")
    new = new.detach().contiguous()
    flat_new, flat_old = new.reshape(-1), old.reshape(-1)
    digest = (_digest_thread().submit(tensor_digest, new)  # while this thread sweeps
              if new.device.type == "cpu" and as_bytes(new).numel() >= _OVERLAPPED_DIGEST_BYTES
              else None)
    positions, values = _diff(flat_new, flat_old, _position_dtype(new.numel()))
    return build_patch(new, positions, values=values,
                       digest=None if digest is None else digest.result())


_OVERLAPPED_DIGEST_BYTES = 8 << 20
"""From this size on, a host tensor's digest is taken on another thread while the sweep runs
(both let go of the GIL): below it, handing it over costs more than it saves."""


@functools.cache
def _digest_thread() -> ThreadPoolExecutor:
    """The thread that takes digests beside the sweep (one per process, started at the first
    large delta)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-digest")


def _position_dtype(numel: int) -> torch.dtype:
    """How a patch of a tensor of ``numel`` elements stores positions."""
    return torch.int32 if numel < 2**31 else torch.int64


def diff_into(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat positions (int64, ascending) where the flat contiguous ``new`` differs bitwise
    from ``old`` (same size and dtype, on any device), compared where ``new`` lives; ``old``
    is then updated to equal ``new`` (only the changed elements are written)."""
    return _diff(new, old, torch.int64)[0]


def _diff(new: torch.Tensor, old: torch.Tensor, position_dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`diff_into`'s positions and the changed elements' new values (as
    :func:`flat_words` reads them): host tensors swept once
    (:func:`~weightsync_core.data.delta.kernels.diff_gather`, positions of
    ``position_dtype``), others with torch's operators (int64 positions)."""
    new_words = flat_words(new)
    swept = diff_gather(new_words, flat_words(old), position_dtype)
    if swept is not None:
        return swept
    old_words = flat_words(old).to(new.device)
    positions = _changed_positions(new_words, old_words)
    values = new_words[positions]
    if old_words.device == old.device:
        old_words.index_copy_(0, positions, values)
    else:  # diffed where the new tensor lives: only the changed elements go back
        flat_words(old).index_copy_(0, positions.to(old.device), values.to(old.device))
    return positions, values


def patch_payload_bytes(numel: int, changed: int, word_bytes: int) -> dict[PatchKind, int]:
    """The payload bytes (header not counted) of each encoding that can hold a patch of a
    tensor of ``numel`` elements of ``word_bytes`` bytes of which ``changed`` changed."""
    position_bytes = 4 if numel < 2**31 else 8
    sizes = {
        PatchKind.POSITIONS: _padded(changed * position_bytes) + _padded(changed * word_bytes),
        PatchKind.BITMASK: _padded(-(-numel // 8)) + _padded(changed * word_bytes),
        PatchKind.WHOLE: _padded(numel * word_bytes),
    }
    return {PatchKind.UNCHANGED: 0, **sizes} if changed == 0 else sizes


def cheapest_kind(numel: int, changed: int, word_bytes: int) -> PatchKind:
    """The smallest encoding of a tensor of ``numel`` elements of ``word_bytes`` bytes of
    which ``changed`` changed."""
    sizes = patch_payload_bytes(numel, changed, word_bytes)
    return min((size, kind) for kind, size in sizes.items())[1]


def build_patch(new: torch.Tensor, positions: torch.Tensor | None,
                changed: int | None = None, values: torch.Tensor | None = None,
                digest: tuple[int, int] | None = None) -> tuple[torch.Tensor, PatchStats]:
    """The patch of the contiguous tensor ``new`` whose elements at the flat ``positions``
    (ascending) changed, in the cheapest encoding (:func:`cheapest_kind`), with the digest of
    the whole of ``new``. ``positions`` may be None where ``changed`` elements changed and
    that encoding needs none (the whole tensor, or nothing); ``values``, the elements at
    ``positions`` where the caller has them already (as :func:`flat_words` reads them);
    ``digest``, :func:`tensor_digest` of ``new`` where the caller took it.

    Raises:
        ValueError: ``positions`` None where the encoding needs them.
    """
    new_words = flat_words(new)
    numel = new_words.numel()
    word_bytes = new_words.element_size()
    if positions is not None:
        changed = positions.numel()
    if changed is None:
        raise ValueError("build_patch needs the positions or the number changed")
    kind = cheapest_kind(numel, changed, word_bytes)
    header = _header(kind, digest or tensor_digest(new), numel, changed, new.device)
    if kind == PatchKind.UNCHANGED:
        return header, PatchStats(kind, numel, 0, PATCH_HEADER_BYTES)
    if kind == PatchKind.WHOLE:
        sections = [_section(new_words.view(torch.uint8), numel * word_bytes)]
    elif positions is None:
        raise ValueError(f"a {kind.name} patch of {changed} of {numel} elements needs their "
                         "positions")
    else:
        positions = positions.to(new.device)
        if kind == PatchKind.POSITIONS:
            where = positions.to(_position_dtype(numel)).view(torch.uint8)
        else:
            changed_mask = torch.zeros(numel, dtype=torch.bool, device=new.device)
            changed_mask[positions.long()] = True
            where = _pack_bits(changed_mask)
        if values is None:
            values = new_words[positions.long()]
        sections = [_section(where, where.numel()),
                    _section(values.to(new.device).view(torch.uint8), changed * word_bytes)]
    patch = torch.cat([header, *sections])
    return patch, PatchStats(kind, numel, changed, patch.numel())


def _changed_positions(new_words: torch.Tensor, old_words: torch.Tensor) -> torch.Tensor:
    """Flat positions (int64, ascending) where ``new_words`` and ``old_words`` differ.

    Narrow elements are compared eight bytes at a time first: only the 8-byte words that
    differ are looked at element by element (with a few percent changed, that is most of
    the time saved: the element-wise compare and ``nonzero`` run over 2 to 8 times fewer
    items)."""
    width = new_words.element_size()
    lanes = 8 // width
    numel = new_words.numel()
    if width >= 8 or numel % lanes or new_words.storage_offset() % lanes or (
            old_words.storage_offset() % lanes):
        return (new_words != old_words).nonzero().reshape(-1)
    words = (new_words.view(torch.int64) != old_words.view(torch.int64)).nonzero().reshape(-1)
    new_lanes = new_words.view(-1, lanes).index_select(0, words)
    old_lanes = old_words.view(-1, lanes).index_select(0, words)
    flat = (new_lanes != old_lanes).reshape(-1).nonzero().reshape(-1)
    return words[flat // lanes] * lanes + flat % lanes


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as bits, eight to a byte, first element in the lowest bit."""
    padding = -mask.numel() % 8
    if padding:
        mask = torch.cat([mask, mask.new_zeros(padding)])
    weights = _BIT_WEIGHTS.to(mask.device)
    return (mask.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(bits: torch.Tensor, numel: int) -> torch.Tensor:
    weights = _BIT_WEIGHTS.to(bits.device)
    return (bits.reshape(-1, 1) & weights).ne(0).reshape(-1)[:numel]


def _typed(section: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``section`` (``uint8``) read as ``dtype`` (copied where it is not aligned for it)."""
    try:
        return section.view(dtype)
    except RuntimeError:
        return section.clone().view(dtype)


def apply_patch(patch: torch.Tensor, baseline: torch.Tensor, name: str) -> PatchStats:
    """Apply ``patch`` to ``baseline`` (contiguous, in place), then check the whole result
    against the sender's digest.

    Raises:
        ValueError: ``patch`` is no patch of a tensor of ``baseline``'s size (names ``name``).
        PatchDigestError: the result differs from the sender's tensor (the baseline was not
            the sender's).
    """
    if patch.dtype != torch.uint8 or patch.dim() != 1 or patch.numel() < PATCH_HEADER_BYTES:
        raise ValueError(f"tensor {name!r}: a delta sync sent {patch.dtype} "
                         f"{list(patch.shape)}, which is no patch")
    magic, kind, digest_kind, numel, changed, digest = _HEADER.unpack(
        bytes(patch[:PATCH_HEADER_BYTES].cpu().numpy()))
    words = flat_words(baseline)
    if magic != _MAGIC or kind not in PatchKind.__members__.values() or numel != words.numel():
        raise ValueError(f"tensor {name!r}: the patch (magic {magic!r}, kind {kind}, "
                         f"{numel} elements) does not fit this worker's copy "
                         f"({words.numel()} elements)")
    try:
        _apply_payload(patch[PATCH_HEADER_BYTES:].to(words.device), words, PatchKind(kind),
                       numel, changed, name)
    except (RuntimeError, IndexError) as exc:  # positions out of range, sections cut short
        raise ValueError(f"tensor {name!r}: the patch is malformed ({exc})") from None
    actual = tensor_digest(baseline, digest_kind)[1]
    if actual != digest:
        raise PatchDigestError(name, actual, digest)
    return PatchStats(PatchKind(kind), numel, changed, patch.numel())


def _apply_payload(payload: torch.Tensor, words: torch.Tensor, kind: PatchKind, numel: int,
                   changed: int, name: str) -> None:
    """Write a patch's payload into ``words`` (the receiver's copy, flat)."""
    word_bytes = words.element_size()
    if kind == PatchKind.WHOLE:
        words.copy_(_typed(payload[: numel * word_bytes], words.dtype))
    elif kind != PatchKind.UNCHANGED:
        if kind == PatchKind.POSITIONS:
            position_dtype = _position_dtype(numel)
            where_bytes = changed * position_dtype.itemsize
            positions = _typed(payload[:where_bytes], position_dtype)
        else:
            where_bytes = -(-numel // 8)
            positions = _unpack_bits(payload[:where_bytes], numel).nonzero().reshape(-1)
        start = _padded(where_bytes)
        values = _typed(payload[start : start + changed * word_bytes], words.dtype)
        if positions.numel() != changed or values.numel() != changed:
            raise ValueError(f"tensor {name!r}: the patch announces {changed} changed "
                             f"elements but holds {positions.numel()} positions and "
                             f"{values.numel()} values")
        outside = scatter_checked(words, positions, values)
        if outside is None:  # not a host tensor the sweep reads: torch's operators
            positions = positions.long()
            outside = -1 if not changed or (int(positions.min()) >= 0 and int(
                positions.max()) < numel) else 0
            if outside < 0:
                words.index_copy_(0, positions, values)
        if outside >= 0:
            raise ValueError(f"tensor {name!r}: the patch holds positions outside its "
                             f"{numel} elements")


class PatchDigestError(ValueError):
    """A tensor rebuilt from a patch differs from the sender's (the receiver's copy was not
    the sender's baseline)."""

    def __init__(self, name: str, actual: int, expected: int) -> None:
        super().__init__(f"tensor {name!r} rebuilt from its delta has digest {actual:#018x}, "
                         f"the sender's is {expected:#018x}")
        self.name = name
