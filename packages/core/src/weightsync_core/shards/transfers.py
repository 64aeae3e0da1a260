"""The transfer plan of a sharded sync: which actor rank sends which piece of which tensor
to which rollout worker, built from what each holds and needs, checked by digest."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from weightsync_core.shards.box import Box
from weightsync_core.shards.layout import Layout, Shapes

__all__ = ["Transfer", "TransferPlan"]


@dataclass(frozen=True)
class Transfer:
    """One piece: ``box`` (full-tensor coordinates) of tensor ``name``, from actor rank
    ``sender`` to rollout rank ``receiver``."""

    name: str
    sender: int
    receiver: int
    box: Box


@dataclass(frozen=True)
class TransferPlan:
    """Every piece a sync moves, in the weights' order, then by receiver. Build it with
    :meth:`build`; it holds for as long as the membership and the layouts do."""

    transfers: tuple[Transfer, ...]

    @classmethod
    def build(cls, shapes: Shapes, held: Sequence[Layout], needed: Sequence[Layout],
              itemsizes: Mapping[str, int] | None = None) -> TransferPlan:
        """Intersect what each actor rank holds (``held[rank]``) with what each rollout
        worker needs (``needed[rank]``): every needed element comes from an actor rank that
        holds it, only the rows (boxes) it holds leave it, and where several ranks hold the
        same box (a replicated tensor) the piece goes from the one that sends the fewest
        bytes so far (``itemsizes``: bytes per element by name; 1 where not given).

        Raises:
            ValueError: a layout that does not fit ``shapes``; actor ranks holding pieces of
                one tensor that overlap without being equal; or an element some worker
                needs that no actor rank holds (naming the worker, the tensor and the box).
        """
        for rank, layout in enumerate(held):
            layout.check(shapes, f"actor rank {rank}")
        for rank, layout in enumerate(needed):
            layout.check(shapes, f"rollout rank {rank}")
        load: dict[int, int] = defaultdict(int)
        transfers: list[Transfer] = []
        for name in shapes:
            holders = _holders(name, held)
            itemsize = (itemsizes or {}).get(name, 1)
            for receiver, layout in enumerate(needed):
                want = layout.boxes.get(name)
                if want is None or not want.numel:
                    continue
                covered = 0
                for box, ranks in holders:
                    piece = want.intersection(box)
                    if piece is None:
                        continue
                    sender = min(ranks, key=lambda rank: (load[rank], rank))
                    load[sender] += piece.numel * itemsize
                    covered += piece.numel
                    transfers.append(Transfer(name, sender, receiver, piece))
                if covered != want.numel:
                    raise ValueError(
                        f"rollout rank {receiver} needs {want} of tensor {name!r}, of which "
                        f"the actor ranks hold only {covered} of {want.numel} elements"
                    )
        return cls(tuple(transfers))

    def as_data(self) -> list[list[object]]:
        """The plan as plain data (lists of names, ranks and ranges) to hand to processes."""
        return [[t.name, t.sender, t.receiver, [list(r) for r in t.box.ranges]]
                for t in self.transfers]

    @classmethod
    def from_data(cls, data: Sequence[Sequence[Any]]) -> TransferPlan:
        """The plan of :meth:`as_data`.

        Raises:
            ValueError: data that is not such a plan.
        """
        transfers = []
        for row in data:
            try:
                name, sender, receiver, ranges = row
                box = Box(tuple((int(start), int(stop)) for start, stop in ranges))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"not a transfer plan's row: {row!r} ({exc})") from None
            if not isinstance(name, str) or not isinstance(sender, int) or not isinstance(
                    receiver, int):
                raise ValueError(f"not a transfer plan's row: {row!r}")
            transfers.append(Transfer(name, sender, receiver, box))
        return cls(tuple(transfers))

    @cached_property
    def digest(self) -> str:
        """A digest of the whole plan: processes that compare theirs find a mismatch of
        names, order or pieces before any byte moves."""
        lines = "\n".join(f"{t.name}\t{t.sender}\t{t.receiver}\t{t.box}" for t in self.transfers)
        return hashlib.blake2b(lines.encode(), digest_size=16).hexdigest()

    def sent_by(self, sender: int) -> list[Transfer]:
        """What actor rank ``sender`` sends, in order."""
        return [t for t in self.transfers if t.sender == sender]

    def received_by(self, receiver: int) -> list[Transfer]:
        """What rollout rank ``receiver`` receives, in order."""
        return [t for t in self.transfers if t.receiver == receiver]

    def elements(self, side: str) -> dict[int, int]:
        """Elements each ``"sender"`` or ``"receiver"`` moves."""
        counts: dict[int, int] = defaultdict(int)
        for transfer in self.transfers:
            counts[getattr(transfer, side)] += transfer.box.numel
        return dict(counts)


def _holders(name: str, held: Sequence[Layout]) -> list[tuple[Box, list[int]]]:
    """The distinct boxes of tensor ``name`` the actor ranks hold, each with the ranks that
    hold it.

    Raises:
        ValueError: two ranks hold different boxes that overlap.
    """
    ranks_by_box: dict[Box, list[int]] = {}
    for rank, layout in enumerate(held):
        box = layout.boxes.get(name)
        if box is not None and box.numel:
            ranks_by_box.setdefault(box, []).append(rank)
    boxes = list(ranks_by_box)
    for index, box in enumerate(boxes):
        for other in boxes[index + 1:]:
            if box.intersection(other) is not None:
                raise ValueError(
                    f"tensor {name!r}: actor ranks {ranks_by_box[box]} hold {box} and actor "
                    f"ranks {ranks_by_box[other]} hold {other}, which overlap: each element "
                    "must have one holder, or the same box several"
                )
    return list(ranks_by_box.items())
