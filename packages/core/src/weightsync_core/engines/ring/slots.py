"""Slot accounting of the ring: this process's registered buffers, the slots a rollout
worker's consumer still views (credited upstream once it moves on), and the downstream
neighbour's slots (taken for a write, given back by its credits)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from weightsync_core.bucketing import ViewTrackedBuffers
from weightsync_core.engines.ring.messages import Credit
from weightsync_core.errors import TransferError, WeightSyncError
from weightsync_core.transport import PeerTransport, RemoteBuffer

__all__ = ["Downstream", "HeldSlots", "RegisteredSlots", "WriteGate"]


class RegisteredSlots:
    """This process's bucket buffers, registered with its transport: two on the sender
    (the packer alternates between them), ``slots`` on a rollout worker (its upstream
    writes into them). Whether a consumer still views a slot is tracked by
    :class:`~weightsync_core.bucketing.ViewTrackedBuffers`.

    Args:
        allocate: returns one new, unregistered bucket buffer.
        transport: returns this process's transport (created on first use).
    """

    def __init__(
        self, allocate: Callable[[], torch.Tensor], transport: Callable[[], PeerTransport]
    ) -> None:
        self._allocate = allocate
        self._transport = transport
        self._buffers = ViewTrackedBuffers(self._allocate_registered, 0)
        self._descriptors: list[RemoteBuffer | None] = []

    def __len__(self) -> int:
        return len(self._buffers)

    def __getitem__(self, slot: int) -> torch.Tensor:
        return _present(self._buffers[slot], slot)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every slot's buffer, in slot order."""
        return [_present(buffer, slot) for slot, buffer in enumerate(self._buffers)]

    @property
    def descriptors(self) -> list[RemoteBuffer]:
        """How peers reach every slot, in slot order (what a ``hello`` announces)."""
        return [_present(descriptor, slot) for slot, descriptor in enumerate(self._descriptors)]

    def resize(self, count: int) -> None:
        """Hold ``count`` registered buffers (blocking; kept as they are if the count
        matches already)."""
        if len(self._buffers) == count:
            return
        self.release()
        self._buffers = ViewTrackedBuffers(self._allocate_registered, count)
        self._descriptors = [None] * count
        for slot in range(count):
            self._buffers.replace(slot)

    def reusable(self, slot: int) -> bool:
        """True if nothing outside the engine views ``slot``'s buffer."""
        return self._buffers.reusable(slot)

    def replace(self, slot: int) -> RemoteBuffer:
        """Give ``slot`` a newly allocated, registered buffer (blocking; the old one is
        deregistered and left to whoever still views it); returns its descriptor."""
        old = self._buffers[slot]
        if old is not None:
            self._transport().deregister(old)
        self._buffers.replace(slot)
        return _present(self._descriptors[slot], slot)

    def release(self) -> None:
        """Deregister and drop every buffer."""
        buffers = [buffer for buffer in self._buffers if buffer is not None]
        self._buffers = ViewTrackedBuffers(self._allocate_registered, 0)
        self._descriptors = []
        for buffer in buffers:
            with contextlib.suppress(Exception):
                self._transport().deregister(buffer)

    def _allocate_registered(self, slot: int) -> torch.Tensor:
        buffer = self._allocate()
        self._descriptors[slot] = self._transport().register(buffer)
        return buffer


T = TypeVar("T")


def _present(item: T | None, slot: int) -> T:
    """``item`` of ``slot``, which :meth:`RegisteredSlots.resize` filled."""
    if item is None:
        raise WeightSyncError(f"ring slot {slot} has no registered buffer (released)")
    return item


class HeldSlots:
    """A rollout worker's slots whose tensors its consumer may still view, each with the
    forward of its bucket. Once the consumer asks for more, it is done with them: each is
    handed to ``release`` (which credits it upstream)."""

    def __init__(self, release: Callable[[int, asyncio.Task | None], None]) -> None:
        self._release = release
        self._held: dict[int, asyncio.Task | None] = {}

    def hold(self, slot: int, forward: asyncio.Task | None) -> None:
        """The consumer may view ``slot`` until :meth:`release_all`."""
        self._held[slot] = forward

    def release(self, slot: int, forward: asyncio.Task | None) -> None:
        """Nobody views ``slot``: give it back right away."""
        self._release(slot, forward)

    def release_all(self) -> None:
        """The consumer moved on: give back every held slot."""
        held, self._held = self._held, {}
        for slot, forward in held.items():
            self._release(slot, forward)


class WriteGate:
    """Writes to one peer run side by side; renewing the connection to it (new transport
    metadata) waits until no write is in flight, and no write starts while it runs."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._writes = 0
        self._renewing = False

    @contextlib.asynccontextmanager
    async def writing(self):
        """Hold the connection for one write."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._renewing)
            self._writes += 1
        try:
            yield
        finally:
            async with self._changed:
                self._writes -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def renewing(self):
        """Hold the connection alone, to replace it."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._renewing and self._writes == 0)
            self._renewing = True
        try:
            yield
        finally:
            async with self._changed:
                self._renewing = False
                self._changed.notify_all()


@dataclass
class Downstream:
    """What the downstream neighbour announced in its ``hello`` (and later credits)."""

    peer: Hashable
    slots: list[RemoteBuffer]
    free: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    """Slots given back (in any order): the next bucket goes to whichever is free first."""
    metadata: Any = None
    """The newest transport metadata the downstream announced (with a replaced slot)."""
    unloaded: set[int] = field(default_factory=set)
    """Slots replaced since :attr:`metadata` was last loaded: a write into one of them
    must wait until the connection knows their new buffers."""
    gate: WriteGate = field(default_factory=WriteGate)

    def __post_init__(self) -> None:
        for slot in range(len(self.slots)):
            self.free.put_nowait(slot)

    def take_credit(self, credit: Credit, name: str) -> None:
        """Slot ``credit.slot`` is free again (with a new buffer, if the credit names one);
        ``name`` names the downstream neighbour in errors."""
        if not 0 <= credit.slot < len(self.slots):
            raise TransferError(
                f"{name} gave back slot {credit.slot}, but it has {len(self.slots)} slots",
                peer=name, stage="credit",
            )
        if credit.buffer is not None:  # it replaced that slot's buffer
            self.slots[credit.slot] = credit.buffer
            self.metadata = credit.peer
            self.unloaded.add(credit.slot)
        self.free.put_nowait(credit.slot)
