"""Slot accounting of the ring: this process's registered buffers, and the downstream
neighbour's slots (taken for a write, given back by its credits)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from weightsync_core.api.errors import TransferError, WeightSyncError
from weightsync_core.engines.ring.messages import Credit
from weightsync_core.net.transport import PeerTransport, RemoteBuffer

__all__ = ["Downstream", "RegisteredSlots"]


class RegisteredSlots:
    """This process's bucket buffers, registered with its transport: two on the sender
    (the packer alternates between them), ``slots`` on a rollout worker (its upstream
    writes into them). Nothing outside the engine ever views them: a rollout worker copies
    each bucket out before checking it, so a write into registered memory after the check
    can never reach its server.

    Args:
        allocate: returns one new, unregistered bucket buffer.
        transport: returns this process's transport (created on first use).
    """

    def __init__(
        self, allocate: Callable[[], torch.Tensor], transport: Callable[[], PeerTransport]
    ) -> None:
        self._allocate = allocate
        self._transport = transport
        self._buffers: list[torch.Tensor] = []
        self._descriptors: list[RemoteBuffer] = []

    def __len__(self) -> int:
        return len(self._buffers)

    def __getitem__(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every slot's buffer, in slot order."""
        return list(self._buffers)

    @property
    def descriptors(self) -> list[RemoteBuffer]:
        """How peers reach every slot, in slot order (what a ``hello`` announces)."""
        return list(self._descriptors)

    def resize(self, count: int) -> None:
        """Hold ``count`` registered buffers (blocking; kept as they are if the count
        matches already)."""
        if len(self._buffers) == count:
            return
        self.release()
        for _ in range(count):
            buffer = self._allocate()
            self._descriptors.append(self._transport().register(buffer))
            self._buffers.append(buffer)

    def scrub(self) -> None:
        """Overwrite every buffer with zeros: between syncs, registered memory (which some
        transports let any peer on the network read) holds no weights."""
        for buffer in self._buffers:
            buffer.zero_()

    def release(self) -> None:
        """Deregister and drop every buffer."""
        buffers, self._buffers, self._descriptors = self._buffers, [], []
        for buffer in buffers:
            with contextlib.suppress(Exception):
                self._transport().deregister(buffer)

    def require(self, slot: int) -> torch.Tensor:
        """``slot``'s buffer; :class:`WeightSyncError` if the slots were released."""
        if not 0 <= slot < len(self._buffers):
            raise WeightSyncError(f"ring slot {slot} has no registered buffer (released)")
        return self._buffers[slot]


@dataclass
class Downstream:
    """What the downstream neighbour announced in its ``hello``, and which of its slots are
    free: a slot is taken for one write and given back by exactly one credit."""

    peer: Hashable
    slots: list[RemoteBuffer]
    free: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    """Slots given back (in any order): the next bucket goes to whichever is free first."""
    taken: set[int] = field(default_factory=set)
    """Slots written (or being written) and not yet given back."""

    def __post_init__(self) -> None:
        for slot in range(len(self.slots)):
            self.free.put_nowait(slot)

    async def take(self) -> int:
        """Wait for a free slot and claim it."""
        slot = await self.free.get()
        self.taken.add(slot)
        return slot

    def take_credit(self, credit: Credit, name: str) -> None:
        """Slot ``credit.slot`` is free again; ``name`` names the downstream neighbour in
        errors. A credit for a slot that was not taken (a duplicate) fails the sync: the
        slot may still be in use downstream, and writing into it would corrupt it."""
        if credit.slot not in self.taken:
            state = ("does not exist" if not 0 <= credit.slot < len(self.slots)
                     else "was not written")
            raise TransferError(
                f"{name} gave back slot {credit.slot}, which {state} (of {len(self.slots)} "
                "slots); a duplicate or forged credit: the ring is out of step",
                peer=name, stage="credit",
            )
        self.taken.discard(credit.slot)
        self.free.put_nowait(credit.slot)
