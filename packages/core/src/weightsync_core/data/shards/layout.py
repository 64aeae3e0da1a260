"""Layouts as data: what each process holds (an actor rank) or needs (a rollout worker), a
box per checkpoint tensor; the layouts users have (the whole model, FSDP2's ``Shard(0)``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from weightsync_core.api.errors import MetadataError
from weightsync_core.data.shards.box import Box
from weightsync_core.data.sync_layout import SyncLayout

__all__ = ["Layout", "LayoutMismatchError", "Shapes", "check_coverage", "fsdp_layout"]

Shapes = Mapping[str, Sequence[int]]
"""Every checkpoint tensor's full shape, by name, in the order the weights stream."""


@dataclass(frozen=True)
class Layout:
    """A box per checkpoint tensor name (a name missing: nothing of that tensor).

    ``replicated`` names the tensors whose box every process of the same side holds too
    (an actor's unsharded parameters): the transfer plan may take them from any of those.
    ``empty_by_design`` names the tensors whose box is empty because the layout's split
    ran out of rows for this process (an FSDP rank past the last row; a tensor-parallel
    rank whose share of vLLM's padded vocabulary lies past the last row); any other empty
    box of a non-empty tensor is refused on a worker (:meth:`check`).
    """

    boxes: Mapping[str, Box]
    replicated: frozenset[str] = field(default_factory=frozenset)
    empty_by_design: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def whole(cls, shapes: Shapes) -> Layout:
        """Every tensor whole (today's default: a worker that needs the whole model)."""
        return cls({name: Box.whole(shape) for name, shape in shapes.items()})

    def numel(self) -> int:
        """Elements in all the boxes."""
        return sum(box.numel for box in self.boxes.values())

    def check(self, shapes: Shapes, who: str, needs: bool = False) -> None:
        """Raise where a box names a tensor not in ``shapes`` or does not fit its shape
        (another number of dimensions, or indices past the end); with ``needs`` (a
        worker's layout: what it needs), also where a box of a non-empty tensor holds no
        element (but for :attr:`empty_by_design`): the worker would be handed an empty piece (a
        ``q_proj`` of shape ``[0, 64]``) where it declared a tensor.

        Raises:
            ValueError: naming ``who``, the tensor, the box, the tensor's shape and the fix.
        """
        for name, box in self.boxes.items():
            shape = shapes.get(name)
            if shape is None:
                raise ValueError(f"{who}: its layout names tensor {name!r}, which the "
                                 "weights do not have")
            if not box.fits(shape):
                raise ValueError(f"{who}: its layout's box {box} of tensor {name!r} does not "
                                 f"fit the tensor's shape {list(shape)}; declare boxes within "
                                 "the shape the actor streams (the layout was made for "
                                 "another model)")
            if needs and not box.numel and math.prod(shape) and name not in self.empty_by_design:
                raise ValueError(f"{who}: its layout's box {box} of tensor {name!r} (shape "
                                 f"{list(shape)}) holds no element, so the worker would get "
                                 "an empty piece of it; declare the rows it needs, or leave "
                                 "the tensor out of its layout if it needs none of it")


def fsdp_layout(shapes: Shapes, world_size: int, rank: int) -> Layout:
    """What FSDP2 (``fully_shard``) rank ``rank`` of ``world_size`` holds: of every tensor of
    one dimension or more, its ``Shard(0)`` rows (``torch.chunk``'s split: chunks of
    ``ceil(rows / world_size)`` rows, the last shorter, ranks past the end an empty box, as
    FSDP2 gives them an empty local tensor); 0-dim tensors whole on every rank (replicated).

    Raises:
        ValueError: a rank outside ``0 .. world_size - 1``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not a rank of a world of {world_size}")
    boxes: dict[str, Box] = {}
    replicated: set[str] = set()
    empty: set[str] = set()
    for name, shape in shapes.items():
        if not shape:
            boxes[name] = Box(())
            replicated.add(name)
            continue
        chunk = -(-shape[0] // world_size)
        boxes[name] = Box.along(shape, 0, rank * chunk, (rank + 1) * chunk)  # maybe no rows
        if not boxes[name].numel:
            empty.add(name)
    return Layout(boxes, frozenset(replicated), frozenset(empty))


class LayoutMismatchError(MetadataError):
    """A declared layout that does not fit the weights, or the layouts of a replica that
    leave part of the model to none of its workers: refused before any byte moves.

    Attributes:
        index: the process to blame, in ``prepare()``'s metadata (actor ranks first, then
            the rollout workers; None where no one process stands out); the manager names
            it ("rollout rank 3 (replica 1, worker 1)").
        problem: what is wrong with its layout, as in "returned metadata <problem> from
            prepare()".
    """


def check_coverage(shapes: Shapes, needed: Sequence[Layout],
                   replica_workers: Sequence[int] | None = None, actor_ranks: int = 0) -> None:
    """Raise where the workers of a replica do not together need every element of every
    tensor of ``shapes`` (a replica serving a model with rows no worker of it received).

    ``needed[r]`` is what rollout rank ``r`` needs; ``replica_workers`` the workers of each
    replica, in rollout-rank order (the manager's numbering); None where the replicas are
    not known: then every worker together must cover the model. Workers of one replica may
    overlap (every tensor-parallel rank needs the norms whole; where TP exceeds the KV heads,
    each KV head is needed by several ranks): each still gets exactly its own boxes.

    Raises:
        LayoutMismatchError: naming the replica, its workers (in the manager's numbering)
            with their boxes of the first tensor not covered, the tensor's shape and what no
            worker needs; its ``index`` is a worker that needs a slice of that tensor and
            declares the same layout as another of its replica (two tensor-parallel workers
            of one rank), if any.
    """
    sizes = list(replica_workers) if replica_workers is not None else [len(needed)] * bool(
        needed)
    if sum(sizes) != len(needed):
        raise ValueError(f"replicas of {sizes} workers, but {len(needed)} worker layouts")
    layout = SyncLayout(actor_ranks, tuple(sizes)) if replica_workers is not None and sizes \
        else None
    first = 0
    for replica, count in enumerate(sizes):
        ranks = range(first, first + count)
        first += count
        for name, shape in shapes.items():
            boxes = [needed[rank].boxes.get(name) for rank in ranks]
            missing, example = _uncovered(shape, [box for box in boxes if box is not None])
            if not missing:
                continue
            _not_covered(shapes, needed, layout, replica, ranks, name, missing, example,
                         actor_ranks)


def _not_covered(shapes: Shapes, needed: Sequence[Layout], layout: SyncLayout | None,
                 replica: int, ranks: range, name: str, missing: int, example: Box | None,
                 actor_ranks: int) -> NoReturn:
    """Raise the :class:`LayoutMismatchError` of ``replica``'s workers (``ranks``) that
    leave ``missing`` elements of tensor ``name`` (``example``: a box of them) to none."""
    def worker(rank: int) -> str:
        return layout.rollout_name(rank) if layout is not None else f"rollout rank {rank}"

    shape = list(shapes[name])
    group = (f"the workers of replica {replica} (rollout ranks {ranks.start}.."
             f"{ranks.stop - 1})" if layout is not None else "the rollout workers together")
    holdings = "; ".join(
        f"{worker(rank)} needs {needed[rank].boxes.get(name) or 'none of it'}" for rank in ranks)
    gap = (f"{group} leave {missing} of the {math.prod(shape)} elements of tensor {name!r} "
           f"(shape {shape}) to no worker, e.g. {example} ({holdings})")
    sliced = [rank for rank in ranks if (box := needed[rank].boxes.get(name)) is not None
              and box.numel]  # of the workers that need a slice of the tensor, not none
    same = next(((rank, earlier) for rank in sliced for earlier in sliced
                 if earlier < rank and needed[rank].boxes == needed[earlier].boxes), None)
    if same is not None:
        rank, earlier = same
        cause = (f"{worker(rank)} declares the same layout as {worker(earlier)}: give each "
                 "worker of a tensor-parallel replica its own rank (0 .. size - 1) of the "
                 "replica's size")
        raise LayoutMismatchError(f"{gap}; {cause}", index=actor_ranks + rank,
                                  problem=f"whose layout leaves part of the model to no "
                                          f"worker of its replica ({gap}; {cause})")
    raise LayoutMismatchError(
        f"{gap}: a replica serves the whole model, so its workers' layouts must together "
        "need every element of every tensor; declare the missing rows on one of them (each "
        "tensor-parallel worker its own rank of the replica's size, one geometry for all)")


def _uncovered(shape: Sequence[int], boxes: Sequence[Box]) -> tuple[int, Box | None]:
    """The elements of a tensor of ``shape`` (in range) that none of ``boxes`` holds, and a
    box of some of them (None where every element is held)."""
    total = math.prod(shape)
    clipped = (Box(tuple((min(start, size), min(stop, size))
                         for (start, stop), size in zip(box.ranges, shape, strict=True)))
               for box in boxes if len(box.ranges) == len(shape))
    distinct = list(dict.fromkeys(box for box in clipped if box.numel))
    if not total or Box.whole(shape) in distinct:
        return 0, None
    if sum(box.numel for box in distinct) == total and _disjoint(distinct):
        return 0, None
    # cut every dimension at every box's edges: each cell is inside a box or outside all
    cuts = [sorted({0, size, *(box.ranges[dim][0] for box in distinct),
                    *(box.ranges[dim][1] for box in distinct)})
            for dim, size in enumerate(shape)]
    missing, example = 0, None
    for ranges in itertools.product(*(itertools.pairwise(edges) for edges in cuts)):
        cell = Box(tuple(ranges))
        if cell.numel and not any(box.intersection(cell) == cell for box in distinct):
            missing += cell.numel
            example = example or cell
    return missing, example


def _disjoint(boxes: Sequence[Box]) -> bool:
    """Whether no two of ``boxes`` (distinct, non-empty) share an element; fast where they
    split one dimension and hold all of the others (a tensor-parallel layout's slices)."""
    if len(boxes) < 2:
        return True
    split = [dim for dim in range(len(boxes[0].ranges))
             if len({box.ranges[dim] for box in boxes}) > 1]
    if len(split) == 1:
        ranges = sorted(box.ranges[split[0]] for box in boxes)
        return all(stop <= start for (_, stop), (start, _) in itertools.pairwise(ranges))
    return all(box.intersection(other) is None
               for index, box in enumerate(boxes) for other in boxes[index + 1:])
