"""The ring engine class: set-up, the sender's pipeline, forwarding, and the lifecycle
between syncs (:mod:`weightsync_core.engines.ring` describes the protocol)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Hashable
from typing import Any, ClassVar

import torch

from weightsync_core.api.engine import TransferStats
from weightsync_core.api.errors import (
    EmptyWeightsError,
    SenderAbortedError,
    WeightSyncError,
)
from weightsync_core.data.bucketing import (
    BucketPacker,
    ReceiveBuffers,
    WeightsSource,
    iter_named_tensors,
)
from weightsync_core.data.devices import allocate_bucket, resolve_device, synchronize_device
from weightsync_core.data.sync_layout import SyncLayout
from weightsync_core.data.topology import RingMetadata, RingPlacement, plan_ring
from weightsync_core.engines.options import RingOptions
from weightsync_core.engines.ring.messages import Abort, Final, RingMessage
from weightsync_core.engines.ring.receive import RingReceiver
from weightsync_core.engines.ring.session import EARLY_MESSAGES, RingLink, RingSession
from weightsync_core.engines.ring.slots import RegisteredSlots
from weightsync_core.engines.typed import TypedEngine
from weightsync_core.net.channel import ControlChannel, PeerEndpoints
from weightsync_core.net.transport import PeerTransport

__all__ = ["RingCheckpointEngine"]

_ABORT_NOTICE_SECONDS = 5.0
"""How long a failing hop tries to tell its downstream neighbour that the sync is off."""


class RingCheckpointEngine(TypedEngine[RingMetadata, RingPlacement]):
    """Pipelined ring over a one-sided :class:`PeerTransport` (the protocol:
    :mod:`weightsync_core.engines.ring`).

    Every process keeps its transport, control channel and registered buffers across syncs,
    so adding or removing replicas between syncs only connects the new neighbours. After a
    failed sync, :meth:`abort` drops the buffers (re-registered next sync) so a transfer
    left over from the failed sync can never land in the next one's buffers.

    Args:
        bucket_size: bytes per bucket; the sender holds two buckets, each rollout worker
            ``slots`` buckets.
        **kwargs: the options (:class:`~weightsync_core.engines.RingOptions`: ``device``,
            ``host``, ``slots``, ``keep_buffers``, ``rebuild_group``, and a backend's own) and
            :class:`~weightsync_core.api.engine.CheckpointEngine`'s arguments.
    """

    options_class = RingOptions
    options: RingOptions
    supports_delta: ClassVar[bool] = True
    metadata_type = RingMetadata
    arguments_type = RingPlacement
    family = "ring"

    def __init__(self, bucket_size: int, **kwargs: Any) -> None:
        super().__init__(bucket_size, **kwargs)
        options = self.options
        self.device = resolve_device(options.device, type(self).__name__, "device='cpu'")
        self.host = host = options.host
        self.slots = options.slots
        self.keep_buffers = options.keep_buffers
        self.rebuild_group = options.rebuild_group
        self._endpoints = PeerEndpoints(host, self.create_transport, RingMessage)
        self._placement: RingPlacement | None = None
        self.local_slots = RegisteredSlots(
            lambda: allocate_bucket(self.bucket_size, self.device), lambda: self.transport
        )
        """This process's registered bucket buffers (the sender's two, a worker's slots)."""
        self._copies = self._new_copies()
        self._peers: dict[str, Hashable] = {}
        self._session: RingSession | None = None
        self._early: deque[RingMessage] = deque(maxlen=EARLY_MESSAGES)
        """Messages of another sync a session's reader took (:attr:`RingLink.early`)."""

    @classmethod
    def buckets_in_host_memory(cls, options: Any) -> int:
        """A rollout worker's ``slots`` registered buckets plus up to three copies it checks
        and hands out (the sender holds two); none on a device."""
        if not isinstance(options, RingOptions):
            return super().buckets_in_host_memory(options)
        return 0 if options.device != "cpu" else options.slots + ReceiveBuffers.DEFAULT_SLOTS

    # -- override point for transports ---------------------------------------------------
    @abstractmethod
    def create_transport(self) -> PeerTransport:
        """Override point: this process's transport endpoint (called once, at the first
        sync; a backend returns its :class:`PeerTransport`)."""

    # -- shared state --------------------------------------------------------------------
    @property
    def channel(self) -> ControlChannel[RingMessage]:
        """This process's control channel (bound on first use)."""
        return self._endpoints.channel

    @property
    def transport(self) -> PeerTransport:
        """This process's transport endpoint (created on first use)."""
        return self._endpoints.transport

    def describe(self, placement: RingPlacement | None = None) -> str:
        """``"<Engine> on actor rank 0"`` / ``"... on rollout rank 2"``, for messages."""
        placement = placement or self._placement
        if placement is None:
            return type(self).__name__
        where = "actor rank 0" if placement.position == 0 else (
            f"rollout rank {placement.position - 1}" if placement.position > 0
            else "an idle actor rank"
        )
        return f"{type(self).__name__} on {where}"

    # -- CheckpointEngine ----------------------------------------------------------------
    def announce(self) -> RingMetadata:
        """This process's control channel (bound on first use)."""
        return RingMetadata(endpoint=self.channel.endpoint)

    @classmethod
    def plan(
        cls, layout: SyncLayout, metadata: list[RingMetadata]
    ) -> tuple[list[RingPlacement], list[RingPlacement]]:
        """Actor rank 0 heads the ring, rollout workers follow in rank order
        (:func:`~weightsync_core.data.topology.plan_ring`)."""
        return plan_ring(layout, metadata)

    def join(self, arguments: RingPlacement) -> None:
        """Take this sync's key and place; only the neighbours may reach the channel."""
        self.channel.use_key(self.session_key)
        self.channel.keep_only({e for e in (arguments.upstream, arguments.downstream)
                                if e is not None})
        self._placement = arguments
        if arguments.position >= 0:
            self.local_slots.resize(2 if arguments.position == 0 else self.slots)

    def sends_weights(self) -> bool:
        """Only the ring's head (the first actor rank) reads and sends the weights."""
        return self._placement is not None and self._placement.position == 0

    async def send_weights(
        self, weights: WeightsSource, global_steps: int | None = None
    ) -> TransferStats:
        start = time.perf_counter()
        placement = self._require_placement(sender=True)
        if placement.position < 0:
            async for _ in iter_named_tensors(weights):
                pass
            return TransferStats(seconds=time.perf_counter() - start)
        session = self._open_session(placement)
        packer = BucketPacker(
            self.local_slots.buffers, self.rollout_dtype,
            self.bucket_checksum if self.verify else None, passes=self.passes,
            hash_while_packing=self.hashes_on_host(self.device),
        )
        try:
            await self._send_buckets(session, packer, weights)
            if not packer.num_tensors:
                raise EmptyWeightsError(
                    f"{self.describe(placement)}: the weight stream held no tensors; a sync "
                    "that loads nothing is refused (does iter_weights yield anything?)"
                )
            await session.send_downstream(
                Final(placement.sync_id, packer.manifest, global_steps)
            )
        except BaseException as exc:
            await self._notify_abort(session, exc)
            raise
        finally:
            await self._end_session(session)
        return TransferStats(
            packer.num_tensors, packer.nbytes, packer.num_buckets, time.perf_counter() - start
        )

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield received tensors as views of a copy of their bucket, made out of the
        registered slot before the bucket is checked (chunked tensors are merged into
        memory of their own): what the consumer reads is what was verified, and nothing a
        peer writes into registered memory later reaches it. A copy the consumer still
        views is never reused, so kept tensors are never overwritten."""
        session = self._open_session(self._require_placement(sender=False))
        receiver = RingReceiver(session, self.bucket_checksum, self.verify, self._copies,
                                self.copy_with_checksum)
        try:
            await receiver.greet()
            while not isinstance(message := await receiver.next_message(), Final):
                for item in receiver.deliver(await receiver.accept(message), message):
                    yield item
                item = None  # drop our view: only the consumer's may remain
            await receiver.finish(message)
        except BaseException as exc:
            await self._notify_abort(session, exc)
            raise
        finally:
            await self._end_session(session)

    def finalize(self) -> None:
        """End this sync. The transport, channel and (with ``keep_buffers``) the registered
        buffers stay for the next sync, scrubbed (they hold no weights between syncs);
        peers that left the ring are disconnected (every peer, with ``rebuild_group``)."""
        placement, self._placement = self._placement, None
        neighbours = set() if placement is None or self.rebuild_group else {placement.downstream}
        for endpoint in [e for e in self._peers if e not in neighbours]:
            self._disconnect(endpoint)
        if not self.keep_buffers or self.rebuild_group:
            self.local_slots.release()
            self._copies = self._new_copies()
        else:
            self.local_slots.scrub()

    def abort(self) -> None:
        """After a failed sync anywhere: disconnect every peer, close sockets to neighbours
        and drop the registered buffers, so nothing of the failed sync can touch the next."""
        self._placement = None
        for endpoint in list(self._peers):
            self._disconnect(endpoint)
        self._endpoints.close_outboxes()
        self.local_slots.release()
        self._copies = self._new_copies()

    def close(self) -> None:
        """Release everything, the transport and the channel included (the engine can be
        used again: both are re-created on the next sync)."""
        self.abort()
        self._endpoints.close()

    # -- the sender's pipeline ------------------------------------------------------------
    async def _send_buckets(
        self, session: RingSession, packer: BucketPacker, weights: WeightsSource
    ) -> None:
        """Pack ``weights`` and forward each bucket; returns once the last has left."""
        previous: asyncio.Task | None = None
        async for bucket in packer.pack(weights):
            synchronize_device(self.device)
            # the packer fills the other buffer next: the bucket before this one must
            # have left it by then
            if previous is not None:
                await previous  # its own waits are bounded
            previous = session.spawn(session.forward_bucket(bucket.data, bucket.meta))
        if previous is not None:
            await previous

    # -- internals -----------------------------------------------------------------------
    def _new_copies(self) -> ReceiveBuffers:
        """The buffers a rollout worker copies buckets into (allocated on first use)."""
        return ReceiveBuffers(lambda nbytes: allocate_bucket(nbytes, self.device, mapped=False))

    def _open_session(self, placement: RingPlacement) -> RingSession:
        """This sync's session; one an earlier sync left running is superseded first."""
        if self._session is not None:
            self._session.supersede()
        link = RingLink(self._endpoints, self.local_slots, self.device, self.timeout,
                        self.progress, self.describe(placement), self._early, self.passes)
        self._session = RingSession(link, placement)
        return self._session

    async def _end_session(self, session: RingSession) -> None:
        """Stop ``session``'s background work, and keep the connection it made to the
        downstream neighbour (for the next sync, or for :meth:`finalize` / :meth:`abort` to
        disconnect)."""
        peer = session.downstream_peer
        if peer is not None and session.placement.downstream is not None:
            self._peers[session.placement.downstream] = peer
        await session.close()
        if self._session is session:
            self._session = None

    def _require_placement(self, *, sender: bool) -> RingPlacement:
        placement = self._placement
        if placement is None:
            raise WeightSyncError(
                f"{type(self).__name__}: init_process_group must run before "
                f"{'send_weights' if sender else 'receive_weights'}"
            )
        if sender and placement.position > 0:
            raise WeightSyncError(f"{self.describe(placement)} cannot send weights")
        if not sender and placement.position <= 0:
            raise WeightSyncError(f"{self.describe(placement)} cannot receive weights")
        return placement

    async def _notify_abort(self, session: RingSession, exc: BaseException) -> None:
        """Best effort: tell the downstream neighbour the sync is off, so it raises now
        instead of at its timeout."""
        placement = session.placement
        if placement.downstream is None:
            return
        reason = str(exc) if isinstance(exc, SenderAbortedError) else (
            f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        )
        message = Abort(placement.sync_id, reason)
        with contextlib.suppress(BaseException):
            await self.channel.send(placement.downstream, message, _ABORT_NOTICE_SECONDS)

    def _disconnect(self, endpoint: str) -> None:
        peer = self._peers.pop(endpoint)
        if self._endpoints.has_transport:
            with contextlib.suppress(Exception):
                self.transport.disconnect(peer)
