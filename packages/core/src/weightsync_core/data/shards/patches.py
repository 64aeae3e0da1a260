"""A delta sync of sliced weights: each actor rank diffs the pieces it sends against its
copy of its own shard, and each rollout worker patches its copy of its own box piece by
piece, every patched piece checked whole against its sender's digest (which the patch
carries) before the server sees the tensor. The versions are delta sync's
(:class:`~weightsync_core.data.delta.DeltaSender`,
:class:`~weightsync_core.data.delta.DeltaReceiver`): a sync that fails leaves no process
claiming a version, so the next sync is a full one."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch

from weightsync_core.api.errors import VerificationError
from weightsync_core.data.delta.codec import (
    DeltaPlan,
    DeltaReceiver,
    DeltaSender,
    host_copy,
    layout_changed,
)
from weightsync_core.data.delta.patch import encode_patch
from weightsync_core.data.shards.box import Box
from weightsync_core.data.shards.pieces import WholePieces

__all__ = ["SliceDecoder", "SliceEncoder"]


class SliceEncoder:
    """An actor rank's :class:`~weightsync_core.data.shards.PieceEncoder` for one sync of
    ``plan``: a full sync sends the pieces whole and keeps a host copy of each shard in
    ``sender``; a delta sync sends each distinct piece as a patch against that copy, then
    brings the copy up to date. Call :meth:`end` once every shard was sent.

    Raises:
        DeltaBaselineError: a delta sync against a version ``sender`` does not hold.
    """

    def __init__(self, sender: DeltaSender, plan: DeltaPlan, who: str) -> None:
        self.sender = sender
        self.plan = plan
        self.who = who
        self.stats = sender.begin(plan, who)
        self.seen: set[str] = set()

    def pieces(self, name: str, shard: torch.Tensor, boxes: Sequence[Box]
               ) -> list[torch.Tensor]:
        """Each of ``boxes`` of ``shard`` as it travels (a box sent to several workers is
        encoded once).

        Raises:
            ManifestChangedError: a delta sync meets a shard its copy does not match in
                shape or dtype (the copies are dropped).
        """
        self.seen.add(name)
        stats = self.stats
        stats.elements += shard.numel()
        stats.model_bytes += shard.numel() * shard.element_size()
        if not self.plan.is_delta:
            self.sender.baselines[name] = host_copy(shard)
            stats.changed += shard.numel()
            pieces = WholePieces().pieces(name, shard, boxes)
        else:
            start = time.perf_counter()
            encoded = self._patches(name, shard, list(dict.fromkeys(boxes)))
            stats.seconds += time.perf_counter() - start
            pieces = [encoded[box] for box in boxes]
        stats.wire_bytes += sum(piece.numel() for piece in pieces)
        return pieces

    def _patches(self, name: str, shard: torch.Tensor, boxes: list[Box]
                 ) -> dict[Box, torch.Tensor]:
        """The patch of each of the distinct ``boxes``; the copy of ``shard`` is then
        ``shard``. Boxes that do not overlap are diffed straight against their part of
        the copy (which writes only the changed elements; through a contiguous copy of
        that part where it is not contiguous)."""
        copy = self.sender.baselines.get(name)
        if copy is None or copy.shape != shard.shape or copy.dtype != shard.dtype:
            self.sender.forget()
            raise layout_changed(name, None if copy is None else (copy.shape, copy.dtype),
                                 shard)
        disjoint = all(a.intersection(b) is None for a, b in itertools.combinations(boxes, 2))
        olds = {box: box.cut(copy) for box in boxes}
        if not disjoint:  # each diffed against the last version, not one patched before
            olds = {box: old.clone(memory_format=torch.contiguous_format)
                    for box, old in olds.items()}
        patches = {}
        for box in boxes:
            old = olds[box]
            target = old if old.is_contiguous() else old.contiguous()
            patches[box], patch_stats = encode_patch(box.cut(shard), target)
            if target is not old and disjoint:
                old.copy_(target)
            self.stats.changed += patch_stats.changed
        if not disjoint or sum(box.numel for box in boxes) != shard.numel():
            copy.copy_(shard)
        return patches

    def end(self) -> None:
        """Every shard was sent: the sender holds this sync's version."""
        self.sender.end(self.plan, self.seen)


class SliceDecoder:
    """A rollout worker's :class:`~weightsync_core.data.shards.PieceDecoder` for one sync
    of ``plan``: a full sync places the pieces and keeps a host copy of each box in
    ``receiver``; a delta sync patches that copy piece by piece (each patched piece checked
    against its sender's digest) and hands the server a copy of it. Call :meth:`end` once
    every box was received.

    Raises:
        DeltaBaselineError: a delta sync against a version ``receiver`` does not hold.
    """

    def __init__(self, receiver: DeltaReceiver, plan: DeltaPlan, who: str) -> None:
        self.receiver = receiver
        self.plan = plan
        self.who = who
        self.stats = receiver.begin(plan, who)
        self.seen: set[str] = set()

    @property
    def patches(self) -> bool:
        """Whether the pieces travel as patches."""
        return self.plan.is_delta

    def begin(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor (a full sync), or this worker's copy of ``name`` (a delta sync).

        Raises:
            VerificationError: a delta sync of a box this worker holds no copy of, or one
                of another shape or dtype (the copies are dropped).
        """
        self.seen.add(name)
        if not self.plan.is_delta:
            return torch.empty(shape, dtype=dtype)
        copy = self.receiver.copy_of(name, self.who)
        if tuple(copy.shape) != shape or copy.dtype != dtype:
            self.receiver.forget()
            raise VerificationError(
                f"{self.who}: its copy of tensor {name!r} is {list(copy.shape)} {copy.dtype}, "
                f"but the delta sync patches {list(shape)} {dtype}; nothing was loaded, and "
                "this worker gets a full copy next sync", tensors=[name])
        return copy

    def place(self, name: str, out: torch.Tensor, box: Box, data: torch.Tensor) -> None:
        """Copy the piece into ``out`` (a full sync) or patch ``out``'s part with it.

        Raises:
            VerificationError: the patched piece differs from its sender's (the copies are
                dropped).
        """
        self.stats.wire_bytes += data.numel()
        if not self.plan.is_delta:
            WholePieces().place(name, out, box, data)
            return
        target = box.cut(out)
        piece = target if target.is_contiguous() else target.contiguous()
        self.receiver.apply(name, data, piece, self.who, self.stats)
        if piece is not target:
            target.copy_(piece)

    def finish(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """The server's tensor of ``name``: ``out`` itself (a full sync, whose copy is
        kept), or a copy of the patched copy (the next sync patches it)."""
        self.stats.elements += out.numel()
        self.stats.model_bytes += out.numel() * out.element_size()
        if self.plan.is_delta:
            return out.clone()
        self.receiver.keep(name, out.clone())
        self.stats.changed += out.numel()
        return out

    def end(self) -> None:
        """Every box was received: the worker holds this sync's version."""
        self.receiver.end(self.plan, self.seen)
