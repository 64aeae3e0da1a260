"""The collective-broadcast engine class: hooks for device backends, the sender's and the
receivers' pipelines (:mod:`weightsync_core.engines.broadcast` describes the design)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import torch
from torch.distributed.distributed_c10d import Store

import weightsync_core.engines.broadcast.protocol as protocol
from weightsync_core.api.engine import TransferStats
from weightsync_core.api.errors import (
    EmptyWeightsError,
    SenderAbortedError,
    TransferError,
    WeightSyncError,
)
from weightsync_core.api.hosts import default_host
from weightsync_core.data import devices
from weightsync_core.data.bucketing import (
    BucketPacker,
    BucketUnpacker,
    PackedBucket,
    ReceiveBuffers,
    WeightsSource,
    iter_named_tensors,
)
from weightsync_core.data.sync_layout import SyncLayout
from weightsync_core.data.topology import (
    EVERY_LOCAL_ACTOR_RANK,
    BroadcastArguments,
    BroadcastMetadata,
    plan_broadcast,
)
from weightsync_core.data.verification import DeliveryVerifier
from weightsync_core.engines.broadcast.group import BroadcastGroup, Collective, GroupLifecycle
from weightsync_core.engines.broadcast.protocol import (
    AbortMessage,
    BroadcastMessage,
    BucketMessage,
    FinalMessage,
    Posted,
)
from weightsync_core.engines.broadcast.relay import BroadcastRelay
from weightsync_core.engines.options import CollectiveBroadcastOptions
from weightsync_core.engines.typed import TypedEngine
from weightsync_core.net.blocking import retrieve_exception, run_blocking
from weightsync_core.net.wire import MessageSealer

__all__ = ["CollectiveBroadcastCheckpointEngine"]

_MAX_IN_FLIGHT = 4
"""Messages the sender keeps posted ahead of the receivers."""


class CollectiveBroadcastCheckpointEngine(
    BroadcastRelay, TypedEngine[BroadcastMetadata, BroadcastArguments]
):
    """Broadcast buckets from a sending actor rank to its rollout workers over one group.

    Topology (see :mod:`weightsync_core.data.topology`): actor rank 0 is group rank 0 (the
    sender), rollout worker ``i`` is group rank ``i + 1``; other actor ranks get rank ``-1``
    and only drain their weight iterator. With ``senders > 1``, relay actor ranks on rank 0's
    host each lead a group of their own share of the rollout workers.

    Args:
        bucket_size: bytes per bucket (two on a sender, up to three on a receiver).
        **kwargs: the options (:class:`~weightsync_core.engines.CollectiveBroadcastOptions`:
            ``host``, ``senders``, ``rebuild_group``, ...) and
            :class:`~weightsync_core.api.engine.CheckpointEngine`'s arguments.
    """

    supports_delta: ClassVar[bool] = True
    device_type: ClassVar[str] = "cpu"
    options_class = CollectiveBroadcastOptions
    options: CollectiveBroadcastOptions
    metadata_type = BroadcastMetadata
    arguments_type = BroadcastArguments
    family = "broadcast"

    @classmethod
    def buckets_in_host_memory(cls, options: Any) -> int:
        """Three in host memory (a sender two, a receiver up to three); none where the
        engine keeps its buckets on a device (nccl, hccl)."""
        return 0 if cls.device_type != "cpu" else super().buckets_in_host_memory(options)

    def __init__(self, bucket_size: int, **kwargs: Any) -> None:
        super().__init__(bucket_size, **kwargs)
        options = self.options
        direct = options.direct_send_megabytes
        if direct is None:
            self.direct_min_bytes: int | None = max(self.bucket_size // 2, 1)
        elif direct < 0:
            self.direct_min_bytes = None
        else:
            self.direct_min_bytes = max(int(direct * (1 << 20)), 1)
        self.host = options.host
        self.group_name = options.group_name
        self.keep_buffers = options.keep_buffers
        self.senders = EVERY_LOCAL_ACTOR_RANK if options.multi_sender else options.senders
        self.rebuild_group = options.rebuild_group
        self.group_init_timeout = float(options.group_init_timeout)
        self.member_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.world_size = 0
        self._lifecycle = GroupLifecycle(
            type(self).__name__, self.group_name, self.group_init_timeout
        )
        self._healthy = True
        self._send_buffers: list[torch.Tensor] = []
        self.device = self.current_device()
        self._receive_buffers = ReceiveBuffers(self.allocate_receive_buffer)

    # -- override points for device backends ---------------------------------------------
    def current_device(self) -> torch.device:
        """Override point: the device this engine uses (called once, at construction:
        worker threads may have another current device). By default the device of
        :attr:`device_type`."""
        return devices.resolve_device(self.device_type, type(self).__name__, "backend='gloo'")

    def allocate_bucket(self) -> torch.Tensor:
        """Override point: one bucket buffer on this engine's device."""
        return devices.allocate_bucket(self.bucket_size, self.device)

    def allocate_receive_buffer(self, nbytes: int) -> torch.Tensor:
        """Override point: a buffer on this engine's device that one received bucket of
        ``nbytes`` fills whole (not zero-filled first)."""
        return devices.allocate_bucket(nbytes, self.device, mapped=False)

    def new_data_group(
        self, store: Store, rank: int, world_size: int, control: Collective
    ) -> Collective:
        """Override point: the communicator for bucket bytes, built on ``store`` (this
        group's own) for ``rank`` of ``world_size``; by default the gloo ``control`` group
        itself."""
        return control

    def synchronize_device(self) -> None:
        """Override point: block until the device's current stream is idle: copies into a
        bucket are done before it is sent, and a collective is done before its bucket is
        reused or read. No-op on host memory."""
        devices.synchronize_device(self.device)

    # -- CheckpointEngine ----------------------------------------------------------------
    def announce(self) -> BroadcastMetadata:
        """Reserve a port (served if this process becomes a group's rank 0) and offer the
        group it holds for reuse."""
        host = self._own_host()
        return BroadcastMetadata(
            host=host, port=self._lifecycle.reserve_port(host), member=self.member_id,
            group=self._lifecycle.key, senders=self.senders,
        )

    @classmethod
    def plan(
        cls, layout: SyncLayout, metadata: list[BroadcastMetadata]
    ) -> tuple[list[BroadcastArguments], list[BroadcastArguments]]:
        """Each sender's group of rollout workers
        (:func:`~weightsync_core.data.topology.plan_broadcast`)."""
        return plan_broadcast(layout, metadata)

    def join(self, arguments: BroadcastArguments) -> None:
        """Keep the group held where every member reports it intact, else build the group
        anew (an actor rank of rank -1 only gives its reserved port up)."""
        rank, world_size, master = (arguments.rank, arguments.world_size,
                                    arguments.master_metadata)
        sealer = MessageSealer(self.session_key)
        if rank >= 0 and master is not None and master.reuse:
            self._lifecycle.reuse(rank, master, arguments.members, sealer)
            self.rank, self.world_size = rank, world_size
            return
        self._destroy_group()
        self.rank, self.world_size = rank, world_size
        if rank < 0:
            self._lifecycle.close_listener()
            return
        if master is None:
            raise WeightSyncError(
                f"{type(self).__name__}: group rank {rank} needs the group's master_metadata "
                "(from build_topology) to join it"
            )
        self._lifecycle.build(
            rank, world_size, master, arguments.members, sealer, host=self._own_host(),
            timeout=self.timeout, new_data_group=self.new_data_group,
        )
        self._healthy = True

    def sends_weights(self) -> bool:
        """Only actor rank 0 (group rank 0) reads and sends the weights."""
        return self.rank == 0

    async def send_weights(
        self, weights: WeightsSource, global_steps: int | None = None
    ) -> TransferStats:
        start = time.perf_counter()
        group = self._require_group(sender=True)
        if group is None:
            async for _ in iter_named_tensors(weights):
                pass
            return TransferStats(seconds=time.perf_counter() - start)
        in_flight: deque[tuple[asyncio.Future, bool]] = deque()
        completed = False
        try:
            if not self._send_buffers:
                self._send_buffers = [self.allocate_bucket() for _ in range(2)]
            packer = BucketPacker(
                self._send_buffers, self.rollout_dtype,
                self.bucket_checksum if self.verify else None, self.direct_min_bytes,
                passes=self.passes,
                hash_while_packing=self.hashes_on_host(self._send_buffers[0].device),
            )
            await self._send_buckets(group, packer, weights, in_flight)
            if not packer.num_tensors:
                raise EmptyWeightsError(
                    f"{type(self).__name__} on {group.sender}: the weight stream held no "
                    "tensors; a sync that loads nothing is refused (does iter_weights yield "
                    "anything?)"
                )
            final = FinalMessage(packer.manifest, global_steps)
            await run_blocking(self._wait, group, self._post_message(group, final))
            completed = True
        except Exception as exc:
            await self._abort(group, [waiter for waiter, _ in in_flight], exc)
            raise
        finally:
            self._healthy = self._healthy and completed
            for waiter, _ in in_flight:  # cancelled mid-sync: nobody will await these
                waiter.add_done_callback(retrieve_exception)
        return TransferStats(
            packer.num_tensors, packer.nbytes, packer.num_buckets, time.perf_counter() - start
        )

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield received tensors as views of their bucket; a bucket is never overwritten
        while a yielded tensor still views it (see :class:`ReceiveBuffers`)."""
        group = self._require_group(sender=False)
        if group is None:
            raise WeightSyncError(
                f"{type(self).__name__}: rollout rank {self.rank} has no group (did "
                "init_process_group fail?)"
            )
        unpacker = BucketUnpacker(copy=False)
        verifier = DeliveryVerifier(self.bucket_checksum)
        buffers = self._receive_buffers
        index = 0
        completed = False
        pending: asyncio.Future | None = asyncio.ensure_future(
            self._receive_message(group, functools.partial(buffers.take, index))
        )
        try:
            while True:
                with self.passes.timed("receive"):
                    message, data = await pending
                pending = None
                if not isinstance(message, BucketMessage):
                    self._end_stream(group, message, verifier, unpacker)
                    completed = True
                    return
                index += 1
                pending = asyncio.ensure_future(
                    self._receive_message(group, functools.partial(buffers.take, index)))
                if self.verify:
                    with self.passes.timed("receiver_checksum"):
                        verifier.check_bucket(data, message.meta, source=group.sender)
                for item in unpacker.unpack(data, message.meta):
                    verifier.record(*item)
                    yield item
                # drop our own views of this bucket so that its buffer can be reused
                data = item = None
        finally:
            self._healthy = self._healthy and completed
            if pending is not None:
                pending.cancel()

    def finalize(self) -> None:
        """End this sync; the group stays for the next sync unless ``rebuild_group`` is set
        or this sync failed here."""
        if self.rebuild_group or not self._healthy:
            self._destroy_group()
        self._release_buffers()

    def abort(self) -> None:
        """Drop the group, the receive buffers and the listening socket whatever their state
        (after a failed sync anywhere): transfers left over from it can touch nothing the
        next sync uses."""
        self._receive_buffers = ReceiveBuffers(self.allocate_receive_buffer)
        self._lifecycle.close_listener()
        self._destroy_group()
        self._release_buffers()

    # -- group and buffers ---------------------------------------------------------------
    @property
    def _group(self) -> BroadcastGroup | None:
        """This process's group (kept across syncs while its members stay)."""
        return self._lifecycle.group

    def _own_host(self) -> str:
        return self.host or default_host()

    def _release_buffers(self) -> None:
        if not self.keep_buffers:
            self._send_buffers = []
            self._receive_buffers = ReceiveBuffers(self.allocate_receive_buffer)

    def _destroy_group(self) -> None:
        self._lifecycle.destroy()
        self.rank = None

    def _require_group(self, *, sender: bool) -> BroadcastGroup | None:
        """This sync's group (None on an actor rank that only drains its weights)."""
        if self.rank is None:
            raise WeightSyncError(
                f"{type(self).__name__}: init_process_group must run before "
                f"{'send_weights' if sender else 'receive_weights'}"
            )
        if sender and self.rank > 0:
            raise WeightSyncError(f"rollout rank {self.rank} cannot send weights")
        if not sender and self.rank <= 0:
            raise WeightSyncError(f"actor rank (group rank {self.rank}) cannot receive weights")
        return self._group if self.rank >= 0 else None

    # -- pipelines -----------------------------------------------------------------------
    async def _send_buckets(
        self, group: BroadcastGroup, packer: BucketPacker, weights: WeightsSource,
        in_flight: deque[tuple[asyncio.Future, bool]],
    ) -> None:
        """Post every packed bucket, each waited for on a worker thread (``in_flight``:
        the waits, each with whether its bucket is direct); returns once all have left."""
        async for bucket in packer.pack(weights):
            self.synchronize_device()
            works = self._post_message(group, BucketMessage(bucket.meta), bucket.data)
            waiter = asyncio.ensure_future(run_blocking(self._wait, group, works))
            in_flight.append((waiter, bucket.direct))
            # Before the packer fills again, the packed bucket before the latest one must
            # have left (its buffer is next); a direct tensor must have left before the
            # iterator is advanced; and only so many messages stay on the wire.
            last_chunk = bucket.direct and _ends_tensor(bucket)
            while in_flight and (
                len(in_flight) > _MAX_IN_FLIGHT
                or sum(not direct for _, direct in in_flight) > 1
                or (last_chunk and any(direct for _, direct in in_flight))
            ):
                await in_flight.popleft()[0]
        while in_flight:
            await in_flight.popleft()[0]

    def _end_stream(
        self, group: BroadcastGroup, message: FinalMessage | AbortMessage,
        verifier: DeliveryVerifier, unpacker: BucketUnpacker,
    ) -> None:
        """End the stream on ``message`` (every message but a bucket ends it), after checking
        the delivery; an abort raises."""
        if isinstance(message, AbortMessage):
            raise SenderAbortedError(
                f"{group.sender} aborted the sync, so rollout rank {self.rank} stops: "
                f"{message.reason}"
            )
        verifier.finish(message.manifest, incomplete=unpacker.incomplete())

    # -- wire protocol (the methods tests override to tamper with the wire) --------------
    def _wait(self, group: BroadcastGroup, works: Posted) -> None:
        """Block until every posted broadcast completes (on the device too); name the stage
        that failed."""
        for work, stage in works:
            try:
                work.wait()
                self.synchronize_device()
            except RuntimeError as exc:
                peer = "the rollout workers" if self.rank == 0 else group.sender
                raise TransferError(
                    f"{type(self).__name__}: broadcast of {stage} failed on group rank "
                    f"{self.rank} (peer: {peer}): {exc}",
                    peer=peer, stage=stage,
                ) from exc

    def _post_message(
        self, group: BroadcastGroup, message: BroadcastMessage, data: torch.Tensor | None = None
    ) -> Posted:
        """Enqueue header, sealed metadata and bucket bytes of one message, in that order."""
        return protocol.post_message(group, message, data)

    async def _receive_message(
        self, group: BroadcastGroup, buffer: Callable[[int], torch.Tensor]
    ) -> tuple[BroadcastMessage, torch.Tensor]:
        """Receive one message into ``buffer(nbytes)`` on a worker thread (header, then the
        rest), so the event loop stays free to hand out the previous bucket meanwhile."""
        return await run_blocking(
            protocol.receive_message, group, buffer, self.bucket_size, self._wait, self.rank
        )

    async def _abort(
        self, group: BroadcastGroup, in_flight: list[asyncio.Future], exc: BaseException
    ) -> None:
        """Tell receivers the sync is off, so they raise instead of waiting for a timeout."""
        limit = min(self.timeout, 30.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.gather(*in_flight, return_exceptions=True), timeout=limit
            )
        if any(w.cancelled() or not w.done() or w.exception() is not None for w in in_flight):
            return  # the group itself is broken; receivers will see that error
        if isinstance(exc, TransferError):
            return
        with contextlib.suppress(Exception):
            works = self._post_message(group, AbortMessage(f"{type(exc).__name__}: {exc}"))
            await asyncio.wait_for(run_blocking(self._wait, group, works), timeout=limit)


def _ends_tensor(bucket: PackedBucket) -> bool:
    """True if the bucket holds the last piece of its (first) tensor."""
    meta = bucket.meta.tensors[0]
    return meta.chunk_offset + meta.nbytes == meta.total_nbytes
