"""Layouts as data: what each process holds (an actor rank) or needs (a rollout worker), a
box per checkpoint tensor; the layouts users have (the whole model, FSDP2's ``Shard(0)``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from weightsync_core.shards.box import Box

__all__ = ["Layout", "Shapes", "fsdp_layout"]

Shapes = Mapping[str, Sequence[int]]
"""Every checkpoint tensor's full shape, by name, in the order the weights stream."""


@dataclass(frozen=True)
class Layout:
    """A box per checkpoint tensor name (a name missing: nothing of that tensor).

    ``replicated`` names the tensors whose box every process of the same side holds too
    (an actor's unsharded parameters): the transfer plan may take them from any of those.
    """

    boxes: Mapping[str, Box]
    replicated: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def whole(cls, shapes: Shapes) -> Layout:
        """Every tensor whole (today's default: a worker that needs the whole model)."""
        return cls({name: Box.whole(shape) for name, shape in shapes.items()})

    def numel(self) -> int:
        """Elements in all the boxes."""
        return sum(box.numel for box in self.boxes.values())

    def check(self, shapes: Shapes, who: str) -> None:
        """Raise where a box names a tensor not in ``shapes`` or does not fit its shape.

        Raises:
            ValueError: naming ``who``, the tensor and the box.
        """
        for name, box in self.boxes.items():
            shape = shapes.get(name)
            if shape is None:
                raise ValueError(f"{who}: its layout names tensor {name!r}, which the "
                                 "weights do not have")
            if not box.fits(shape):
                raise ValueError(f"{who}: its layout's box {box} of tensor {name!r} does not "
                                 f"fit the tensor's shape {list(shape)}")


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
    for name, shape in shapes.items():
        if not shape:
            boxes[name] = Box(())
            replicated.add(name)
            continue
        chunk = -(-shape[0] // world_size)
        boxes[name] = Box.along(shape, 0, rank * chunk, (rank + 1) * chunk)  # maybe no rows
    return Layout(boxes, frozenset(replicated))
