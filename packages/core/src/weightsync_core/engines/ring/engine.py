"""Ring engine: buckets travel actor rank 0 -> rollout worker 0 -> rollout worker 1 -> ...

This is the shared pipeline of the ``nixl`` and ``mooncake`` backends; a subclass only
supplies its :class:`~weightsync_core.transport.PeerTransport`.

Each hop writes a bucket one-sidedly into a free slot of the next hop's registered buffers,
then says so on the control channel (:class:`~weightsync_core.channel.ControlChannel`). A
rollout worker forwards bucket ``k`` to its downstream neighbour while its own server reads
it, and frees the slot (a credit to its upstream) once both are done; meanwhile bucket
``k+1`` lands in its other slot. With ``B`` buckets and ``n`` rollout workers a sync takes
about ``B + n - 1`` bucket times instead of ``n * B``.

Messages (:mod:`~weightsync_core.engines.ring_messages`: a fixed schema, sealed with the
sync's session key, each tagged with the sync's id so that leftovers of an aborted sync are
ignored): downstream to upstream ``hello`` (transport metadata and slot addresses, at the
start of a sync) and ``credit`` (a slot is free again); upstream to downstream ``bucket``
(slot and :class:`~weightsync_core.bucketing.BucketMeta`), ``final`` (the manifest) and
``abort``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import abstractmethod
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync_core.base import CheckpointEngine, TransferStats
from weightsync_core.blocking import run_blocking
from weightsync_core.bucketing import (
    BucketMeta,
    BucketPacker,
    BucketUnpacker,
    WeightsSource,
    iter_named_tensors,
    storage_refs,
)
from weightsync_core.channel import ControlChannel, PeerEndpoints
from weightsync_core.devices import allocate_bucket, resolve_device, synchronize_device
from weightsync_core.engines.ring_messages import (
    Abort,
    BucketReady,
    Credit,
    Final,
    Hello,
    RingMessage,
)
from weightsync_core.errors import (
    EmptyWeightsError,
    SenderAbortedError,
    TransferError,
    WeightSyncError,
)
from weightsync_core.topology import ring_topology
from weightsync_core.transport import PeerTransport, RemoteBuffer
from weightsync_core.verification import DeliveryVerifier

__all__ = ["RingCheckpointEngine"]

_ABORT_NOTICE_SECONDS = 5.0
"""How long a failing hop tries to tell its downstream neighbour that the sync is off."""


@dataclass(frozen=True)
class _Placement:
    """This process's place in one sync's ring (from :func:`ring_topology`)."""

    position: int
    sync_id: str
    upstream: str | None
    upstream_name: str | None
    downstream: str | None
    downstream_name: str | None


class _WriteGate:
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
class _Downstream:
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
    gate: _WriteGate = field(default_factory=_WriteGate)


class _Session:
    """One sync's control traffic in this process: routes inbox messages to the main loop
    (from upstream) or to the slot credits (from downstream), and fails fast when any
    background task of the sync fails."""

    def __init__(self, engine: RingCheckpointEngine, placement: _Placement) -> None:
        self.engine = engine
        self.placement = placement
        self.from_upstream: asyncio.Queue[BucketReady | Final | Abort] = asyncio.Queue()
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._hello: asyncio.Future[Hello] = asyncio.get_running_loop().create_future()
        self._downstream: _Downstream | None = None
        self._connecting: asyncio.Lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._reader = asyncio.ensure_future(self._read_inbox())

    # -- background work -----------------------------------------------------------------
    def spawn(self, coroutine) -> asyncio.Task:
        """Run ``coroutine`` in the background; its failure fails the session."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.fail(task.exception())

    def fail(self, exc: BaseException) -> None:
        """Make every wait of this session raise ``exc`` (the first failure wins)."""
        if not self.failed.done():
            self.failed.set_exception(exc)
            self.failed.exception()  # reported through the waits, not the loop's handler

    async def wait(self, awaitable, *, timeout: float, on_timeout: str, peer: str) -> Any:
        """Await ``awaitable``, but raise as soon as the session fails, and raise a
        :class:`TransferError` naming ``peer`` and the stage after ``timeout`` seconds."""
        task = asyncio.ensure_future(awaitable)
        try:
            with self.engine.progress.waiting_on(peer, on_timeout):
                done, _ = await asyncio.wait(
                    {task, self.failed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
        except BaseException:
            task.cancel()
            raise
        if task in done:
            return task.result()
        task.cancel()
        if self.failed.done():
            raise self.failed.exception()
        raise TransferError(
            f"{self.engine.describe(self.placement)} waited {timeout:.0f}s for {peer} "
            f"({on_timeout}); is it alive? (sync_timeout_seconds bounds every wait)",
            peer=peer, stage=on_timeout,
        )

    async def _read_inbox(self) -> None:
        channel = self.engine.channel
        try:
            while True:
                message: RingMessage = await channel.receive()
                if message.sync != self.placement.sync_id:
                    continue  # a leftover of an earlier, aborted sync
                if isinstance(message, BucketReady | Final | Abort):
                    self.from_upstream.put_nowait(message)
                elif isinstance(message, Hello) and not self._hello.done():
                    self._hello.set_result(message)
                elif isinstance(message, Credit) and self._downstream is not None:
                    self._credit(self._downstream, message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a member broke the protocol: nothing else is in order
            self.fail(exc)

    def _credit(self, downstream: _Downstream, credit: Credit) -> None:
        if not 0 <= credit.slot < len(downstream.slots):
            raise TransferError(
                f"{self.placement.downstream_name} gave back slot {credit.slot}, but it has "
                f"{len(downstream.slots)} slots", peer=self.placement.downstream_name,
                stage="credit",
            )
        if credit.buffer is not None:  # it replaced that slot's buffer
            downstream.slots[credit.slot] = credit.buffer
            downstream.metadata = credit.peer
            downstream.unloaded.add(credit.slot)
        downstream.free.put_nowait(credit.slot)

    def supersede(self) -> None:
        """A newer sync started in this process while this one was still running (its
        caller's cancellation never arrived): fail its waits and stop its inbox reader now,
        so that it cannot take, and drop, the newer sync's messages."""
        self.fail(TransferError(
            f"{self.engine.describe(self.placement)}: a newer sync started while this one "
            "was still running", stage="superseded",
        ))
        for task in [self._reader, *self._tasks]:
            task.cancel()

    async def close(self) -> None:
        """Stop the inbox reader and every background task of this session."""
        for task in [self._reader, *self._tasks]:
            task.cancel()
        await asyncio.gather(self._reader, *self._tasks, return_exceptions=True)

    # -- downstream neighbour ------------------------------------------------------------
    async def downstream(self) -> _Downstream:
        """The downstream neighbour, connected on its first ``hello``."""
        async with self._connecting:
            if self._downstream is None:
                placement, engine = self.placement, self.engine
                hello = await self.wait(
                    asyncio.shield(self._hello), timeout=engine.timeout,
                    on_timeout="waiting for its hello", peer=placement.downstream_name,
                )
                with engine.progress.waiting_on(placement.downstream_name, "connecting to it"):
                    peer = await run_blocking(engine.connect_peer, hello.peer)
                self._downstream = _Downstream(peer, list(hello.slots), metadata=hello.peer)
                for slot in range(len(self._downstream.slots)):
                    self._downstream.free.put_nowait(slot)
        return self._downstream

    async def take_slot(self, index: int) -> tuple[_Downstream, int]:
        """Wait until a downstream slot is free for bucket ``index``; claim it. If the slot
        got a new buffer, load the downstream's newest transport metadata first (alone on
        the connection: no other write uses it meanwhile)."""
        downstream = await self.downstream()
        slot = await self.wait(
            downstream.free.get(), timeout=self.engine.timeout,
            on_timeout=f"a free slot for bucket {index}", peer=self.placement.downstream_name,
        )
        if slot in downstream.unloaded:
            async with downstream.gate.renewing():
                if slot in downstream.unloaded:  # not already loaded by another forward
                    downstream.unloaded.clear()
                    with self.engine.progress.waiting_on(self.placement.downstream_name,
                                                         "reconnecting to it"):
                        downstream.peer = await run_blocking(
                            self.engine.connect_peer, downstream.metadata
                        )
        return downstream, slot

    async def send(self, endpoint: str, peer: str, message: RingMessage) -> None:
        """Send ``message`` to a neighbour."""
        await self.wait(
            self.engine.channel.send(endpoint, message, self.engine.timeout),
            timeout=self.engine.timeout + 1,
            on_timeout=f"sending {type(message).__name__.lower()}", peer=peer,
        )


class RingCheckpointEngine(CheckpointEngine):
    """Pipelined ring over a one-sided :class:`PeerTransport` (see the module docstring).

    Every process keeps its transport, control channel and registered buffers across syncs,
    so adding or removing replicas between syncs only connects the new neighbours. After a
    failed sync, :meth:`abort` drops the buffers (re-registered next sync) so a transfer
    left over from the failed sync can never land in the next one's buffers.

    Args:
        bucket_size: bytes per bucket; the sender holds two buckets, each rollout worker
            ``slots`` buckets.
        device: ``"cpu"`` (host memory) or ``"cuda"``: where buckets live.
        host: address of this process's control channel (default: ``WEIGHTSYNC_HOST``, the
            Ray node IP, or ``127.0.0.1``).
        slots: receive buffers per rollout worker (2 = double buffering).
        rebuild_group: verl's name for starting every sync afresh: after each sync, every
            peer is disconnected and the buffers are deregistered (as after a failure), so
            the next sync connects and registers again, as verl's engines do.
        keep_buffers: keep registered buffers between syncs; off, they are deregistered and
            freed in every :meth:`finalize`.
        **kwargs: see :class:`~weightsync_core.base.CheckpointEngine`.
    """

    def __init__(
        self,
        bucket_size: int,
        *,
        device: str = "cpu",
        host: str | None = None,
        slots: int = 2,
        keep_buffers: bool = True,
        rebuild_group: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(bucket_size, **kwargs)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if not isinstance(slots, int) or slots < 2:
            raise ValueError(f"slots must be an integer >= 2 (double buffering), got {slots!r}")
        self.device = resolve_device(device, type(self).__name__, "device='cpu'")
        self.host = host
        self.slots = slots
        self.keep_buffers = keep_buffers
        self.rebuild_group = rebuild_group
        self._endpoints = PeerEndpoints(host, self._create_transport, RingMessage)
        self._placement: _Placement | None = None
        self._buffers: list[torch.Tensor] = []
        self._descriptors: list[RemoteBuffer] = []
        self._baselines: list[int | None] = []
        self._peers: dict[str, Hashable] = {}
        self._session: _Session | None = None

    # -- hook for transports -------------------------------------------------------------
    @abstractmethod
    def _create_transport(self) -> PeerTransport:
        """This process's transport endpoint (created once, at the first sync)."""

    # -- shared state --------------------------------------------------------------------
    @property
    def channel(self) -> ControlChannel[RingMessage]:
        """This process's control channel (bound on first use)."""
        return self._endpoints.channel

    @property
    def transport(self) -> PeerTransport:
        """This process's transport endpoint (created on first use)."""
        return self._endpoints.transport

    def describe(self, placement: _Placement | None = None) -> str:
        """``"<Engine> on actor rank 0"`` / ``"... on rollout rank 2"``, for messages."""
        placement = placement or self._placement
        if placement is None:
            return type(self).__name__
        where = "actor rank 0" if placement.position == 0 else (
            f"rollout rank {placement.position - 1}" if placement.position > 0
            else "an idle actor rank"
        )
        return f"{type(self).__name__} on {where}"

    def connect_peer(self, metadata: Any) -> Hashable:
        """Connect to a neighbour through the transport (blocking)."""
        return self.transport.connect(metadata)

    # -- CheckpointEngine ----------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        return {"endpoint": self.channel.endpoint}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return ring_topology(actor_wg_world_size, rollout_world_size, metadata)

    def init_process_group(
        self,
        position: int,
        sync_id: str,
        upstream: str | None = None,
        upstream_name: str | None = None,
        downstream: str | None = None,
        downstream_name: str | None = None,
    ) -> None:
        placement = _Placement(
            position, sync_id, upstream, upstream_name, downstream, downstream_name
        )
        self.channel.use_key(self.session_key)
        self.channel.keep_only({e for e in (upstream, downstream) if e is not None})
        self._placement = placement
        if position < 0:
            return
        wanted = 2 if position == 0 else self.slots
        if len(self._buffers) != wanted:
            self._release_buffers()
            for _ in range(wanted):
                self._buffers.append(None)
                self._descriptors.append(None)
                self._baselines.append(None)
                self._replace_buffer(len(self._buffers) - 1)

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
            self._buffers, self.rollout_dtype, self.bucket_checksum if self.verify else None
        )
        try:
            previous: asyncio.Task | None = None
            async for bucket in packer.pack(weights):
                synchronize_device(self.device)
                # the packer fills the other buffer next: the bucket before this one must
                # have left it by then
                if previous is not None:
                    await previous  # its own waits are bounded
                previous = session.spawn(self._forward(session, bucket.data, bucket.meta))
            if previous is not None:
                await previous
            if not packer.num_tensors:
                raise EmptyWeightsError(
                    f"{self.describe(placement)}: the weight stream held no tensors; a sync "
                    "that loads nothing is refused (does iter_weights yield anything?)"
                )
            await self._send_downstream(
                session, Final(placement.sync_id, packer.manifest, global_steps)
            )
        except BaseException as exc:
            await self._notify_abort(session, exc)
            raise
        finally:
            await session.close()
        return TransferStats(
            packer.num_tensors, packer.nbytes, packer.num_buckets, time.perf_counter() - start
        )

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield received tensors as views of their slot where possible (chunked tensors are
        merged into memory of their own). A slot is written again only after the consumer
        moved past its tensors; if the consumer still holds a view then, the slot gets a new
        buffer instead, so kept tensors are never overwritten."""
        placement = self._require_placement(sender=False)
        session = self._open_session(placement)
        unpacker = BucketUnpacker(copy=False)
        verifier = DeliveryVerifier(self.bucket_checksum)
        upstream = placement.upstream_name
        forward: asyncio.Task | None = None
        # slots whose tensors the consumer may still view, with the forward of their bucket
        viewed: dict[int, asyncio.Task | None] = {}

        def release(slot: int) -> None:
            session.spawn(self._free_slot(session, slot, viewed.pop(slot)))

        try:
            # a server may still hold views from the last sync: those slots get new buffers
            for index, buffer in enumerate(self._buffers):
                if storage_refs(buffer) != self._baselines[index]:
                    await run_blocking(self._replace_buffer, index)
            hello = Hello(placement.sync_id, self.transport.metadata(), list(self._descriptors))
            await session.send(placement.upstream, upstream, hello)
            expected = 0
            while True:
                # At most one slot (the last bucket's) is held back here, so with two or more
                # slots the upstream always has one to write the next bucket into.
                message = await session.wait(
                    session.from_upstream.get(), timeout=self.timeout,
                    on_timeout=f"waiting for bucket {expected}", peer=upstream,
                )
                if isinstance(message, Abort):
                    raise SenderAbortedError(
                        f"{upstream} aborted the sync, so {self.describe(placement)} stops: "
                        f"{message.reason}"
                    )
                if isinstance(message, Final):
                    if forward is not None:
                        await forward
                    await self._send_downstream(session, message)
                    verifier.finish(message.manifest, incomplete=unpacker.incomplete())
                    return
                meta, slot = message.meta, message.slot
                self._check_announcement(placement, meta, slot, expected)
                expected += 1
                data = self._buffers[slot][: meta.nbytes]
                synchronize_device(self.device)
                if placement.downstream is not None:
                    forward = session.spawn(self._forward(session, data, meta, forward))
                if self.verify:
                    # on a worker thread: the loop keeps forwarding and crediting meanwhile
                    await run_blocking(verifier.check_bucket, data, meta, source=upstream)
                yielded = False
                for item in unpacker.unpack(data, meta):
                    verifier.record(*item)
                    yield item
                    yielded = True
                    # the consumer asked for more: it is done with earlier buckets' tensors
                    for earlier in list(viewed):
                        release(earlier)
                data = item = None  # drop our views: only the consumer's may remain
                viewed[slot] = forward
                if not yielded:  # chunks only: copied out, nobody views this slot
                    release(slot)
        except BaseException as exc:
            await self._notify_abort(session, exc)
            raise
        finally:
            await session.close()

    def finalize(self) -> None:
        """End this sync. The transport, channel and (with ``keep_buffers``) the registered
        buffers stay for the next sync; peers that left the ring are disconnected (every
        peer, with ``rebuild_group``)."""
        placement, self._placement = self._placement, None
        neighbours = set() if placement is None or self.rebuild_group else {placement.downstream}
        for endpoint in [e for e in self._peers if e not in neighbours]:
            self._disconnect(endpoint)
        if not self.keep_buffers or self.rebuild_group:
            self._release_buffers()

    def abort(self) -> None:
        """After a failed sync anywhere: disconnect every peer, close sockets to neighbours
        and drop the registered buffers, so nothing of the failed sync can touch the next."""
        self._placement = None
        for endpoint in list(self._peers):
            self._disconnect(endpoint)
        self._endpoints.close_outboxes()
        self._release_buffers()

    def close(self) -> None:
        """Release everything, the transport and the channel included (the engine can be
        used again: both are re-created on the next sync)."""
        self.abort()
        self._endpoints.close()

    # -- internals -----------------------------------------------------------------------
    def _open_session(self, placement: _Placement) -> _Session:
        """This sync's session; one an earlier sync left running is superseded first."""
        if self._session is not None:
            self._session.supersede()
        self._session = _Session(self, placement)
        return self._session

    def _require_placement(self, *, sender: bool) -> _Placement:
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

    def _check_announcement(
        self, placement: _Placement, meta: BucketMeta, slot: int, expected: int
    ) -> None:
        """Refuse a bucket announcement that is out of order or does not fit its slot."""
        upstream = placement.upstream_name
        stage = f"bucket {expected}"
        if meta.index != expected or not 0 <= slot < len(self._buffers):
            raise TransferError(
                f"{self.describe(placement)} expected bucket {expected} but {upstream} "
                f"announced bucket {meta.index} in slot {slot}; the ring is out of step",
                peer=upstream, stage=stage,
            )
        try:
            meta.check(self._buffers[slot].numel())
        except ValueError as exc:
            raise TransferError(
                f"{self.describe(placement)}: {upstream} announced a bucket that does not "
                f"fit: {exc}", peer=upstream, stage=stage,
            ) from exc

    async def _forward(
        self, session: _Session, data: torch.Tensor, meta: BucketMeta,
        previous: asyncio.Task | None = None,
    ) -> None:
        """Write one bucket into a free downstream slot, then announce it (after the
        previous bucket's announcement, so they arrive in order)."""
        placement = session.placement
        downstream, slot = await session.take_slot(meta.index)
        self._peers[placement.downstream] = downstream.peer
        stage = f"writing bucket {meta.index}"
        target = downstream.slots[slot]
        if meta.nbytes > target.nbytes:
            raise TransferError(
                f"{self.describe(placement)} has a {meta.nbytes}-byte bucket but "
                f"{placement.downstream_name} has {target.nbytes}-byte slots; use the same "
                "update_weights_bucket_megabytes on both sides",
                peer=placement.downstream_name, stage=stage,
            )
        try:
            async with downstream.gate.writing():
                await session.wait(
                    run_blocking(
                        self.transport.write, downstream.peer, data,
                        target.at(0, meta.nbytes), self.timeout,
                    ),
                    timeout=self.timeout + 5, on_timeout=stage, peer=placement.downstream_name,
                )
        except TransferError as exc:
            if exc.peer:  # already names the peer (a timeout of this wait)
                raise
            raise TransferError(
                f"{self.describe(placement)}: {stage} to {placement.downstream_name} failed: "
                f"{exc}", peer=placement.downstream_name, stage=stage, code=exc.code,
            ) from exc
        if previous is not None:
            await previous
        await self._send_downstream(session, BucketReady(placement.sync_id, slot, meta))

    async def _free_slot(
        self, session: _Session, slot: int, forward: asyncio.Task | None
    ) -> None:
        """Give ``slot`` back to the upstream neighbour once it has been forwarded; if the
        consumer still views its buffer, announce a fresh buffer for it instead."""
        if forward is not None:
            await forward
        placement = session.placement
        credit = Credit(placement.sync_id, slot)
        if storage_refs(self._buffers[slot]) != self._baselines[slot]:
            buffer = await run_blocking(self._replace_buffer, slot)
            credit = Credit(placement.sync_id, slot, buffer, self.transport.metadata())
        await session.send(placement.upstream, placement.upstream_name, credit)

    async def _send_downstream(self, session: _Session, message: RingMessage) -> None:
        placement = session.placement
        if placement.downstream is not None:
            await session.send(placement.downstream, placement.downstream_name, message)

    async def _notify_abort(self, session: _Session, exc: BaseException) -> None:
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

    def _replace_buffer(self, slot: int) -> RemoteBuffer:
        """Give ``slot`` a newly allocated, registered buffer (the old one is deregistered
        and left to whoever still views it)."""
        old = self._buffers[slot]
        if old is not None:
            self.transport.deregister(old)
        buffer = allocate_bucket(self.bucket_size, self.device)
        self._descriptors[slot] = self.transport.register(buffer)
        self._buffers[slot] = buffer
        self._baselines[slot] = storage_refs(buffer)
        return self._descriptors[slot]

    def _release_buffers(self) -> None:
        buffers = self._buffers
        self._buffers, self._descriptors, self._baselines = [], [], []
        for buffer in buffers:
            with contextlib.suppress(Exception):
                self.transport.deregister(buffer)
