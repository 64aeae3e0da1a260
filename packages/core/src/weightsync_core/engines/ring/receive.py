"""A rollout worker's side of one ring sync, in named steps: greet the upstream, take each
announced bucket (check, forward, verify), hand its tensors to the consumer, and credit
each slot back once the consumer has moved past it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import torch

from weightsync_core.blocking import run_blocking
from weightsync_core.bucketing import BucketMeta, BucketUnpacker
from weightsync_core.devices import synchronize_device
from weightsync_core.engines.ring.messages import Abort, BucketReady, Credit, Final, Hello
from weightsync_core.engines.ring.session import RingSession
from weightsync_core.engines.ring.slots import HeldSlots
from weightsync_core.errors import SenderAbortedError, TransferError, WeightSyncError
from weightsync_core.verification import DeliveryVerifier

__all__ = ["RingReceiver"]


class RingReceiver:
    """The receiving steps of one sync on a rollout worker (see
    :meth:`RingCheckpointEngine.receive_weights`).

    Args:
        session: this sync's session (its link holds the slots, transport and bounds).
        checksum: the sync's bucket checksum, as the sender computed it.
        verify: check each bucket's checksum and the delivery against the manifest.
    """

    def __init__(self, session: RingSession, checksum: Callable[[torch.Tensor], int],
                 verify: bool) -> None:
        self.session = session
        self.link = session.link
        self.placement = placement = session.placement
        if placement.upstream is None or placement.upstream_name is None:
            raise WeightSyncError(f"{self.link.where} has no upstream neighbour to receive from")
        self.upstream, self.upstream_name = placement.upstream, placement.upstream_name
        self.verify = verify
        self.unpacker = BucketUnpacker(copy=False)
        self.verifier = DeliveryVerifier(checksum)
        self.forward: asyncio.Task | None = None
        self.held = HeldSlots(self._release)
        self.expected = 0

    async def greet(self) -> None:
        """Renew the slots a server still views from the last sync, then announce the
        slots to the upstream neighbour."""
        slots = self.link.slots
        for index in range(len(slots)):
            if not slots.reusable(index):
                await run_blocking(slots.replace, index)
        hello = Hello(self.placement.sync_id, self.link.transport.metadata(), slots.descriptors)
        await self.session.send(self.upstream, self.upstream_name, hello)

    async def next_message(self) -> BucketReady | Final:
        """The upstream's next bucket announcement or its final message (an abort raises).

        At most one slot (the last bucket's) is held back meanwhile, so with two or more
        slots the upstream always has one to write the next bucket into."""
        upstream = self.upstream_name
        message = await self.session.wait(
            self.session.from_upstream.get(), timeout=self.link.timeout,
            on_timeout=f"waiting for bucket {self.expected}", peer=upstream,
        )
        if isinstance(message, Abort):
            raise SenderAbortedError(
                f"{upstream} aborted the sync, so {self.link.where} "
                f"stops: {message.reason}"
            )
        return message

    async def finish(self, final: Final) -> None:
        """Pass the final message on once the last forward is done; check the delivery."""
        if self.forward is not None:
            await self.forward
        await self.session.send_downstream(final)
        self.verifier.finish(final.manifest, incomplete=self.unpacker.incomplete())

    async def accept(self, message: BucketReady) -> torch.Tensor:
        """Check an announced bucket, start forwarding it, verify it; returns its bytes."""
        meta, slot = message.meta, message.slot
        self._check_announcement(meta, slot)
        self.expected += 1
        data = self.link.slots[slot][: meta.nbytes]
        synchronize_device(self.link.device)
        if self.placement.downstream is not None:
            self.forward = self.session.spawn(
                self.session.forward_bucket(data, meta, self.forward)
            )
        if self.verify:
            # on a worker thread: the loop keeps forwarding and crediting meanwhile
            await run_blocking(
                self.verifier.check_bucket, data, meta, source=self.upstream_name
            )
        return data

    def deliver(
        self, data: torch.Tensor, message: BucketReady
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the bucket's tensors as views of its slot; each request for more frees
        the slots of earlier buckets. Afterwards the slot stays held while the consumer
        may view it."""
        yielded = False
        for item in self.unpacker.unpack(data, message.meta):
            self.verifier.record(*item)
            yield item
            yielded = True
            # the consumer asked for more: it is done with earlier buckets' tensors
            self.held.release_all()
        del data  # drop our views: only the consumer's may remain
        item = None
        if yielded:
            self.held.hold(message.slot, self.forward)
        else:  # chunks only: copied out, nobody views this slot
            self.held.release(message.slot, self.forward)

    def _release(self, slot: int, forward: asyncio.Task | None) -> None:
        self.session.spawn(self._free_slot(slot, forward))

    async def _free_slot(self, slot: int, forward: asyncio.Task | None) -> None:
        """Give ``slot`` back to the upstream neighbour once it has been forwarded; if the
        consumer still views its buffer, announce a fresh buffer for it instead."""
        if forward is not None:
            await forward
        placement, slots = self.placement, self.link.slots
        credit = Credit(placement.sync_id, slot)
        if not slots.reusable(slot):
            buffer = await run_blocking(slots.replace, slot)
            credit = Credit(placement.sync_id, slot, buffer, self.link.transport.metadata())
        await self.session.send(self.upstream, self.upstream_name, credit)

    def _check_announcement(self, meta: BucketMeta, slot: int) -> None:
        """Refuse a bucket announcement that is out of order or does not fit its slot."""
        upstream, expected = self.upstream_name, self.expected
        where = self.link.where
        stage = f"bucket {expected}"
        slots = self.link.slots
        if meta.index != expected or not 0 <= slot < len(slots):
            raise TransferError(
                f"{where} expected bucket {expected} but {upstream} announced bucket "
                f"{meta.index} in slot {slot}; the ring is out of step",
                peer=upstream, stage=stage,
            )
        try:
            meta.check(slots[slot].numel())
        except ValueError as exc:
            raise TransferError(
                f"{where}: {upstream} announced a bucket that does not fit: {exc}",
                peer=upstream, stage=stage,
            ) from exc
