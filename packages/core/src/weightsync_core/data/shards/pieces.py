"""What travels of each piece of a transfer plan: the piece itself (:class:`WholePieces`), or
what a codec makes of it (a delta sync's patches: :mod:`.patches`), and how large it may be
(:func:`piece_capacity`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from weightsync_core.data.bucketing import as_bytes
from weightsync_core.data.delta.patch import PATCH_HEADER_BYTES
from weightsync_core.data.shards.box import Box

__all__ = ["PieceDecoder", "PieceEncoder", "WholePieces", "piece_capacity"]


def piece_capacity(nbytes: int) -> int:
    """The most bytes a piece of ``nbytes`` bytes of weights takes as it travels: itself, or
    a patch of it (a delta sync's: at most its header and the piece, padded to 8 bytes)."""
    return PATCH_HEADER_BYTES + -(-nbytes // 8) * 8


class PieceEncoder(Protocol):
    """How an actor rank turns its shard of a tensor into the bytes of the pieces it sends
    (:class:`WholePieces`: the pieces themselves; a delta sync's: patches of them)."""

    def pieces(self, name: str, shard: torch.Tensor, boxes: Sequence[Box]
               ) -> list[torch.Tensor]:
        """The bytes (``uint8``) of each of ``boxes`` (in ``shard``'s coordinates) of
        tensor ``name``, as they travel."""
        ...


class PieceDecoder(Protocol):
    """How a rollout worker builds its box of a tensor from the pieces it receives
    (:class:`WholePieces`: copies them into place; a delta sync's: patches its copy)."""

    @property
    def patches(self) -> bool:
        """Whether pieces travel as patches, whose lengths only their sender knows."""
        ...

    def begin(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor of ``shape`` the pieces of tensor ``name`` are placed into."""
        ...

    def place(self, name: str, out: torch.Tensor, box: Box, data: torch.Tensor) -> None:
        """Place the piece ``box`` (in ``out``'s coordinates), whose bytes as they travelled
        are ``data`` (checked against its sender's checksum)."""
        ...

    def finish(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """The box of tensor ``name`` for the server, once every piece was placed in
        ``out``."""
        ...


class WholePieces:
    """Pieces as they are: a sender sends each box's bytes, a worker copies them into
    place (a :class:`PieceEncoder` and a :class:`PieceDecoder`)."""

    patches = False

    def pieces(self, name: str, shard: torch.Tensor, boxes: Sequence[Box]
               ) -> list[torch.Tensor]:
        return [as_bytes(box.cut(shard)) for box in boxes]

    def begin(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def place(self, name: str, out: torch.Tensor, box: Box, data: torch.Tensor) -> None:
        box.cut(out).copy_(data.view(out.dtype).reshape(box.shape))

    def finish(self, name: str, out: torch.Tensor) -> torch.Tensor:
        return out
