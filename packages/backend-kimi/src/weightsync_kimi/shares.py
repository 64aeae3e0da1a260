"""Which actor rank serves which tensor, and what each rank publishes about its share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from weightsync_core.spi import (
    BucketMeta,
    ManifestEntry,
    RemoteBuffer,
)

__all__ = ["ShareAssigner", "ShareManifest", "ShareMessage", "rollout_nbytes"]


def rollout_nbytes(tensor: torch.Tensor, rollout_dtype: torch.dtype | None) -> int:
    """Bytes of ``tensor`` once cast to the rollout dtype (floating-point tensors only)."""
    if rollout_dtype is not None and tensor.is_floating_point():
        return tensor.numel() * rollout_dtype.itemsize
    return tensor.numel() * tensor.element_size()


class ShareAssigner:
    """Deterministic owner of each tensor: the rank with the fewest bytes so far (lowest rank
    on ties), in stream order. Every actor rank sees the same stream, so every rank computes
    the same assignment without talking to the others."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.loads = [0] * world_size

    def owner(self, nbytes: int) -> int:
        """The rank that serves the next tensor of ``nbytes`` bytes."""
        rank = min(range(len(self.loads)), key=lambda r: (self.loads[r], r))
        self.loads[rank] += nbytes
        return rank


@dataclass
class ShareManifest:
    """What one actor rank serves: where each of its buckets lies, and what they hold.

    Attributes:
        owner: the actor rank.
        peer: its transport metadata (how receivers reach it).
        update_id: the sync that wrote this share (equal on every rank of one update).
        buckets: ``(meta, registered buffer)`` of each bucket, in order.
        tensors: ``(name, shape, dtype)`` of every tensor in the share.
        global_steps: the version of the weights.
        patches: whether the buckets hold delta sync's patches (usable only by receivers
            holding the version before; no cache for a replica added later).
    """

    owner: int
    peer: Any
    update_id: str
    buckets: list[tuple[BucketMeta, RemoteBuffer]] = field(default_factory=list)
    tensors: list[ManifestEntry] = field(default_factory=list)
    global_steps: int | None = None
    patches: bool = False


class ShareMessage(msgspec.Struct, tag="share", frozen=True):
    """An actor rank's share, sent to every replica leader over the control channel (a
    fixed schema, sealed with the sync's key)."""

    sync: str
    share: ShareManifest
