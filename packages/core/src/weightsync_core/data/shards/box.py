"""A box: the part of a checkpoint tensor a process holds or needs, as a half-open range
of indices per dimension, in the full tensor's coordinates."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Box"]


@dataclass(frozen=True)
class Box:
    """``ranges[d] = (start, stop)``: indices ``start .. stop - 1`` of dimension ``d`` of a
    tensor (a 0-dim tensor's box has no ranges and one element).

    Raises:
        ValueError: a range that runs backwards or starts below 0.
    """

    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        for dim, (start, stop) in enumerate(self.ranges):
            if start < 0 or stop < start:
                raise ValueError(f"dimension {dim}: range [{start}, {stop}) is not a range "
                                 "of indices (0 <= start <= stop)")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        """All of a tensor of ``shape``."""
        return cls(tuple((0, size) for size in shape))

    @classmethod
    def along(cls, shape: Sequence[int], dim: int, start: int, stop: int) -> Box:
        """Indices ``start .. stop - 1`` of dimension ``dim`` (clipped to its size), all of
        the others."""
        ranges = [(0, size) for size in shape]
        size = shape[dim]
        ranges[dim] = (min(start, size), min(max(stop, start), size))
        return cls(tuple(ranges))

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the piece this box cuts out."""
        return tuple(stop - start for start, stop in self.ranges)

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return math.prod(self.shape)

    def fits(self, shape: Sequence[int]) -> bool:
        """Whether this box lies within a tensor of ``shape``."""
        return len(self.ranges) == len(shape) and all(
            stop <= size for (_, stop), size in zip(self.ranges, shape, strict=True))

    def intersection(self, other: Box) -> Box | None:
        """The elements both boxes hold (None where they share none)."""
        if len(self.ranges) != len(other.ranges):
            raise ValueError(f"boxes of {len(self.ranges)} and {len(other.ranges)} "
                             "dimensions cannot meet")
        ranges = tuple((max(a, c), min(b, d))
                       for (a, b), (c, d) in zip(self.ranges, other.ranges, strict=True))
        if any(stop <= start for start, stop in ranges):
            return None
        return Box(ranges)

    def within(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which contains it)."""
        return Box(tuple((start - base, stop - base) for (start, stop), (base, _)
                         in zip(self.ranges, outer.ranges, strict=True)))

    def cut(self, tensor: torch.Tensor) -> torch.Tensor:
        """The piece of ``tensor`` (in this box's coordinates) this box names (a view)."""
        return tensor[tuple(slice(start, stop) for start, stop in self.ranges)]

    def __str__(self) -> str:
        return "[" + ", ".join(f"{start}:{stop}" for start, stop in self.ranges) + "]"
