"""The transfer plan of a sharded sync: which actor rank sends which piece of which tensor
to which rollout worker, and which worker relays a piece it received to a worker of another
replica that needs the same slice; built from what each holds and needs, checked by
digest."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from typing import Any

from weightsync_core.data.shards.box import Box
from weightsync_core.data.shards.layout import Layout, LayoutMismatchError, Shapes, check_coverage
from weightsync_core.data.sync_layout import SyncLayout

__all__ = ["Transfer", "TransferPlan"]


@dataclass(frozen=True)
class Transfer:
    """One piece: ``box`` (full-tensor coordinates) of tensor ``name``, from actor rank
    ``sender`` to rollout rank ``receiver``; with ``relayed``, ``sender`` is a rollout rank
    that forwards the same piece, which an earlier transfer of the plan delivered to it."""

    name: str
    sender: int
    receiver: int
    box: Box
    relayed: bool = False

    @property
    def source(self) -> str:
        """Who sends it: ``"actor rank N"`` or, for a relayed piece, ``"rollout rank N"``."""
        return f"{'rollout' if self.relayed else 'actor'} rank {self.sender}"


@dataclass(frozen=True)
class TransferPlan:
    """Every piece a sync moves, in the weights' order, then by receiver. Build it with
    :meth:`build`; it holds for as long as the membership and the layouts do."""

    transfers: tuple[Transfer, ...]

    @classmethod
    def build(cls, shapes: Shapes, held: Sequence[Layout], needed: Sequence[Layout],
              itemsizes: Mapping[str, int] | None = None, relay: bool = False,
              replicas: Sequence[int] | None = None) -> TransferPlan:
        """Intersect what each actor rank holds (``held[rank]``) with what each rollout
        worker needs (``needed[rank]``): every needed element comes from an actor rank that
        holds it, only the rows (boxes) it holds leave it, and where several ranks hold the
        same box (a replicated tensor) the piece goes from the one that sends the fewest
        bytes so far (``itemsizes``: bytes per element by name; 1 where not given).

        With ``relay``, workers that need the same box of a tensor (the same shard in
        different replicas) form a chain: the actor ranks send the box's pieces once, to
        the chain's head (the worker that has relayed the fewest bytes so far), and each
        worker forwards every piece to the next as it arrives; the plan keeps the relays
        only where they lower the bytes of the busiest sender (actor rank or relaying
        worker), and is the plain one otherwise.

        ``replicas``: the workers of each replica, in rollout-rank order (the manager's
        numbering); where given, errors name workers as the manager does ("rollout rank 3
        (replica 1, worker 1)") and each replica's workers must together need every element
        of every tensor (:func:`~weightsync_core.data.shards.layout.check_coverage`).

        Raises:
            LayoutMismatchError: a layout that does not fit ``shapes`` (another number of
                dimensions, indices past the end, an empty box of a non-empty tensor on a
                worker), or, with ``replicas``, a replica whose workers leave part of a
                tensor to none of them (naming the process, the tensor, the box and the
                shape; its ``index`` is the process, actor ranks first).
            ValueError: actor ranks holding pieces of one tensor that overlap without being
                equal; or an element some worker needs that no actor rank holds (naming the
                worker, the tensor and the box).
        """
        names = SyncLayout(len(held), tuple(replicas)) if replicas else None
        for rank, layout in enumerate(held):
            _check(layout, shapes, f"actor rank {rank}", rank, needs=False)
        for rank, layout in enumerate(needed):
            who = names.rollout_name(rank) if names is not None else f"rollout rank {rank}"
            _check(layout, shapes, who, len(held) + rank, needs=True)
        if replicas is not None:
            check_coverage(shapes, needed, replicas, len(held))
        plain = cls(_plan(shapes, held, needed, itemsizes or {}, relay=False))
        if not relay:
            return plain
        relayed = cls(_plan(shapes, held, needed, itemsizes or {}, relay=True))
        if relayed.busiest_sender_bytes(itemsizes) < plain.busiest_sender_bytes(itemsizes):
            return relayed
        return plain

    def as_data(self) -> list[list[object]]:
        """The plan as plain data (lists of names, ranks, ranges and the relayed flag) to
        hand to processes."""
        return [[t.name, t.sender, t.receiver, [list(r) for r in t.box.ranges], t.relayed]
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
                name, sender, receiver, ranges, relayed = row
                box = Box(tuple((int(start), int(stop)) for start, stop in ranges))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"not a transfer plan's row: {row!r} ({exc})") from None
            if not isinstance(name, str) or not isinstance(sender, int) or not isinstance(
                    receiver, int) or not isinstance(relayed, bool):
                raise ValueError(f"not a transfer plan's row: {row!r}")
            transfers.append(Transfer(name, sender, receiver, box, relayed))
        return cls(tuple(transfers))

    @cached_property
    def digest(self) -> str:
        """A digest of the whole plan: processes that compare theirs find a mismatch of
        names, order or pieces before any byte moves."""
        lines = "\n".join(f"{t.name}\t{t.source}\t{t.receiver}\t{t.box}"
                          for t in self.transfers)
        return hashlib.blake2b(lines.encode(), digest_size=16).hexdigest()

    def sent_by(self, sender: int, relayed: bool = False) -> list[Transfer]:
        """What actor rank ``sender`` sends (``relayed``: what rollout rank ``sender``
        forwards), in order."""
        return [t for t in self.transfers if t.sender == sender and t.relayed == relayed]

    def received_by(self, receiver: int) -> list[Transfer]:
        """What rollout rank ``receiver`` receives, in order."""
        return [t for t in self.transfers if t.receiver == receiver]

    def elements(self, side: str) -> dict[int, int]:
        """Elements each ``"sender"`` (actor rank) or ``"receiver"`` (rollout rank) moves;
        ``"relay"``: elements each rollout rank forwards."""
        counts: dict[int, int] = defaultdict(int)
        for transfer in self.transfers:
            if side == "receiver":
                counts[transfer.receiver] += transfer.box.numel
            elif transfer.relayed == (side == "relay"):
                counts[transfer.sender] += transfer.box.numel
        return dict(counts)

    def busiest_sender_bytes(self, itemsizes: Mapping[str, int] | None = None) -> int:
        """The bytes of the process (actor rank or relaying worker) that sends the most
        (``itemsizes``: bytes per element by name; 1 where not given)."""
        load: dict[str, int] = defaultdict(int)
        for transfer in self.transfers:
            load[transfer.source] += transfer.box.numel * (itemsizes or {}).get(
                transfer.name, 1)
        return max(load.values(), default=0)


def _check(layout: Layout, shapes: Shapes, who: str, index: int, needs: bool) -> None:
    """:meth:`Layout.check`, its error a :class:`LayoutMismatchError` blaming process
    ``index`` (actor ranks first)."""
    try:
        layout.check(shapes, who, needs=needs)
    except ValueError as exc:
        raise LayoutMismatchError(str(exc), index=index, problem=layout_problem(exc, who)
                                  ) from None


def layout_problem(exc: Exception, who: str) -> str:
    """What :class:`LayoutMismatchError`'s ``problem`` says of ``who``'s layout that failed
    with ``exc`` (whose message starts with ``who``)."""
    detail = str(exc).removeprefix(f"{who}: ")
    return f"whose layout does not fit the weights actor rank 0 declared ({detail})"


def _plan(shapes: Shapes, held: Sequence[Layout], needed: Sequence[Layout],
          itemsizes: Mapping[str, int], relay: bool) -> tuple[Transfer, ...]:
    """The transfers of :meth:`TransferPlan.build`, with or without relays.

    Raises:
        ValueError: see :meth:`TransferPlan.build`.
    """
    load: dict[int, int] = defaultdict(int)
    relay_load: dict[int, int] = defaultdict(int)
    transfers: list[Transfer] = []
    for name in shapes:
        holders = _holders(name, held)
        itemsize = itemsizes.get(name, 1)
        for want, receivers in _needers(name, needed, relay):
            head = min(receivers, key=lambda rank: (relay_load[rank], rank))
            chain = receivers[receivers.index(head):] + receivers[:receivers.index(head)]
            covered = 0
            pieces = []
            for box, ranks in holders:
                piece = want.intersection(box)
                if piece is None:
                    continue
                sender = min(ranks, key=lambda rank: (load[rank], rank))
                load[sender] += piece.numel * itemsize
                covered += piece.numel
                pieces.append(piece)
                transfers.append(Transfer(name, sender, head, piece))
            if covered != want.numel:
                raise ValueError(
                    f"rollout rank {head} needs {want} of tensor {name!r}, of which "
                    f"the actor ranks hold only {covered} of {want.numel} elements"
                )
            for relayer, receiver in pairwise(chain):
                relay_load[relayer] += want.numel * itemsize
                transfers.extend(Transfer(name, relayer, receiver, piece, relayed=True)
                                 for piece in pieces)
    return tuple(transfers)


def _needers(name: str, needed: Sequence[Layout], relay: bool
             ) -> list[tuple[Box, list[int]]]:
    """The boxes of tensor ``name`` the workers need, each with the workers that need it
    (with ``relay``: all of them, in rank order; else one each)."""
    wanted: list[tuple[Box, list[int]]] = []
    by_box: dict[Box, list[int]] = {}
    for receiver, layout in enumerate(needed):
        want = layout.boxes.get(name)
        if want is None or not want.numel:
            continue
        if relay and want in by_box:
            by_box[want].append(receiver)
            continue
        ranks = [receiver]
        by_box.setdefault(want, ranks)
        wanted.append((want, ranks))
    return wanted


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
