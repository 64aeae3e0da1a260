"""A rollout worker's side of one ring sync, in named steps: greet the upstream, take each
announced bucket (check, forward, copy out of registered memory, verify the copy), hand its
tensors to the consumer, and credit each slot back once it is forwarded and copied."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import torch

from weightsync_core.api.errors import SenderAbortedError, TransferError, WeightSyncError
from weightsync_core.data.bucketing import (
    BucketMeta,
    BucketUnpacker,
    ReceiveBuffers,
    copy_bytes,
    offloaded,
)
from weightsync_core.data.devices import synchronize_device
from weightsync_core.data.verification import DeliveryVerifier
from weightsync_core.engines.ring.messages import Abort, BucketReady, Credit, Final, Hello
from weightsync_core.engines.ring.session import RingSession
from weightsync_core.net.blocking import run_blocking

__all__ = ["RingReceiver"]


class RingReceiver:
    """The receiving steps of one sync on a rollout worker (see
    :meth:`RingCheckpointEngine.receive_weights`).

    Each bucket is copied out of its registered slot into a buffer of this process's own
    (``copies``) before its checksum is checked, and the consumer gets views of that copy:
    the bytes the server reads are the bytes that were verified, whatever a peer writes into
    registered memory afterwards. The slot goes back to the upstream once it is copied and
    forwarded.

    Args:
        session: this sync's session (its link holds the slots, transport and bounds).
        checksum: the sync's bucket checksum, as the sender computed it.
        verify: check each bucket's checksum and the delivery against the manifest.
        copies: the buffers buckets are copied into (reused only while nothing views them).
        copy_with_checksum: copies a bucket and returns ``checksum`` of the copy in one pass,
            or returns None without copying where it cannot
            (:meth:`~weightsync_core.api.engine.CheckpointEngine.copy_with_checksum`).
    """

    def __init__(self, session: RingSession, checksum: Callable[[torch.Tensor], int],
                 verify: bool, copies: ReceiveBuffers,
                 copy_with_checksum: Callable[[torch.Tensor, torch.Tensor], int | None],
                 ) -> None:
        self.session = session
        self.link = session.link
        self.placement = placement = session.placement
        if placement.upstream is None or placement.upstream_name is None:
            raise WeightSyncError(f"{self.link.where} has no upstream neighbour to receive from")
        self.upstream, self.upstream_name = placement.upstream, placement.upstream_name
        self.verify = verify
        self.copies = copies
        self.copy_with_checksum = copy_with_checksum
        self.unpacker = BucketUnpacker(copy=False)
        self.verifier = DeliveryVerifier(checksum)
        self.forward: asyncio.Task | None = None
        self.expected = 0

    async def greet(self) -> None:
        """Announce this worker's slots to the upstream neighbour."""
        slots = self.link.slots
        hello = Hello(self.placement.sync_id, self.link.transport.metadata(), slots.descriptors)
        await self.session.send(self.upstream, self.upstream_name, hello)

    async def next_message(self) -> BucketReady | Final:
        """The upstream's next bucket announcement or its final message (an abort raises)."""
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
        """Check an announced bucket, start forwarding it, copy it out of its slot and
        verify the copy (copy and checksum in one pass on the host; on a device, the check
        runs while the slot is credited back); returns the copy's bytes."""
        meta, slot = message.meta, message.slot
        self._check_announcement(meta, slot)
        self.expected += 1
        data = self.link.slots.require(slot)[: meta.nbytes]
        synchronize_device(self.link.device)
        if self.placement.downstream is not None:
            self.forward = self.session.spawn(
                self.session.forward_bucket(data, meta, self.forward)
            )
        copy = self.copies.take(meta.index, meta.nbytes)[: meta.nbytes]
        if self.verify and meta.checksum is not None:
            with self.link.passes.timed("copy_out_checksum"):
                actual = await offloaded(meta.nbytes, self.copy_with_checksum, copy, data)
            if actual is not None:
                del data
                self.session.spawn(self._credit(slot, self.forward))
                self.verifier.check_checksum(actual, meta, source=self.upstream_name)
                return copy
        with self.link.passes.timed("copy_out"):
            await copy_bytes(copy, data)
            synchronize_device(self.link.device)
        del data
        self.session.spawn(self._credit(slot, self.forward))
        if self.verify:
            # on a worker thread: the loop keeps forwarding and crediting meanwhile
            with self.link.passes.timed("receiver_checksum"):
                await run_blocking(
                    self.verifier.check_bucket, copy, meta, source=self.upstream_name
                )
        return copy

    def deliver(
        self, data: torch.Tensor, message: BucketReady
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the bucket's tensors as views of its copy (a copy the consumer still views
        is never reused)."""
        for item in self.unpacker.unpack(data, message.meta):
            self.verifier.record(*item)
            yield item

    async def _credit(self, slot: int, forward: asyncio.Task | None) -> None:
        """Give ``slot`` back to the upstream neighbour once it has been forwarded."""
        if forward is not None:
            await forward
        credit = Credit(self.placement.sync_id, slot)
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
