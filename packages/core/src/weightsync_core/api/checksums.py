"""How a bucket's bytes are checksummed: part of the contract between the two ends of a
transfer, which must compute the same value (xxh3 on the host, a position-weighted sum on a
device)."""

from __future__ import annotations

import torch
import xxhash

__all__ = [
    "HostDigest",
    "bucket_checksum",
    "copy_with_host_checksum",
    "device_checksum",
    "host_checksum",
]

_COPY_CHUNK_BYTES = 1 << 20
"""What :meth:`HostDigest.copy` copies before it hashes: small enough that the hash reads
the copy from cache (L2 here is 1 MiB per core), large enough that the per-chunk calls cost
little (1 GiB: 1024 chunks)."""


class HostDigest:
    """:func:`host_checksum` of bytes fed in order, in pieces: :meth:`feed` bytes already
    in place, :meth:`copy` bytes while they are copied."""

    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()

    def feed(self, data: torch.Tensor) -> None:
        """Hash the host ``uint8`` tensor ``data`` next."""
        if data.numel():
            self._state.update(data.contiguous().numpy().data)

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy ``source`` into ``target`` (host ``uint8`` tensors of one size) and hash the
        copy next, in one pass: each chunk is hashed from ``target`` right after it is
        copied, while it is still in cache. What is hashed is the copy, so a later write
        into ``source`` cannot make the checksum describe other bytes than ``target``
        holds."""
        if target.numel() != source.numel():
            raise ValueError(f"copy of {source.numel()} bytes into {target.numel()}")
        copied = target.numpy().data
        for start in range(0, target.numel(), _COPY_CHUNK_BYTES):
            end = min(start + _COPY_CHUNK_BYTES, target.numel())
            target[start:end].copy_(source[start:end])
            self._state.update(copied[start:end])

    def value(self) -> int:
        """The checksum of everything fed so far."""
        return self._state.intdigest()


def host_checksum(data: torch.Tensor) -> int:
    """64-bit xxh3 of a ``uint8`` tensor's bytes (copied to host memory if needed)."""
    if data.device.type != "cpu":
        data = data.cpu()
    if data.numel() == 0:
        return xxhash.xxh3_64_intdigest(b"")
    return xxhash.xxh3_64_intdigest(data.contiguous().numpy().data)


def copy_with_host_checksum(target: torch.Tensor, source: torch.Tensor) -> int:
    """Copy ``source`` into ``target`` (host ``uint8`` tensors of one size) and return
    :func:`host_checksum` of the copy, in one pass: each chunk is hashed from ``target``
    right after it is copied, while it is still in cache. What is hashed is the copy, so a
    later write into ``source`` cannot make the checksum describe other bytes than
    ``target`` holds."""
    digest = HostDigest()
    digest.copy(target, source)
    return digest.value()


_CHECKSUM_CHUNK_WORDS = 1 << 24


def device_checksum(data: torch.Tensor) -> int:
    """Checksum of a ``uint8`` tensor computed on its own device (no copy to the host).

    A position-weighted sum of its 32-bit words (weights 1..65521) plus the trailing bytes,
    in int64 arithmetic: any single flipped bit changes it. Used by device engines, where
    hashing on the host would mean copying every bucket back.
    """
    count = data.numel()
    whole = count - count % 4
    words = data[:whole].view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), _CHECKSUM_CHUNK_WORDS):
        chunk = words[start : start + _CHECKSUM_CHUNK_WORDS].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=data.device) % 65521 + 1
        total += (chunk * weights).sum()
    tail = data[whole:].to(torch.int64)
    total += (tail * torch.arange(1, tail.numel() + 1, device=data.device)).sum()
    return int(total.item()) ^ (count << 1)


def bucket_checksum(data: torch.Tensor) -> int:
    """Checksum of a bucket's used bytes, computed where they live (xxh3 on the host,
    :func:`device_checksum` on a device)."""
    return host_checksum(data) if data.device.type == "cpu" else device_checksum(data)
