"""Collective-broadcast engine: actor rank 0 broadcasts each bucket to all rollout workers.

This is the shared pipeline of the ``gloo``, ``nccl`` and ``hccl`` backends. A subclass
overrides only what its hardware needs:

- :attr:`device_type` and :meth:`_allocate_bucket`: where buckets live;
- :meth:`_new_data_group`: the communicator that moves bucket bytes;
- :meth:`_synchronize_device`: stream handling before a bucket is sent or read.

Control messages (bucket metadata, the final manifest, aborts) always travel on a small gloo
group over host memory. Each bucket is one message: a 2-integer header ``[meta_len,
data_len]``, the metadata (a fixed schema sealed with the sync's session key, see
:mod:`weightsync_core.wire`; receivers check the seal before decoding), then the bucket bytes
on the data group. The sender fills bucket ``k+1`` while bucket ``k`` is on the wire;
receivers post the receive of ``k+1`` before unpacking ``k``.

The group's rendezvous store listens on the configured host only, and every key lives under
a prefix derived from the session key: a process outside the sync can neither read the
members' addresses nor claim a rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BroadcastOptions

from weightsync_core.base import CheckpointEngine, TransferStats
from weightsync_core.blocking import retrieve_exception, run_blocking
from weightsync_core.bucketing import (
    BucketMeta,
    BucketPacker,
    BucketUnpacker,
    PackedBucket,
    ReceiveBuffers,
    WeightsSource,
    iter_named_tensors,
)
from weightsync_core.devices import allocate_bucket, resolve_device, synchronize_device
from weightsync_core.engines.options import CollectiveBroadcastOptions
from weightsync_core.errors import (
    EmptyWeightsError,
    MalformedMessageError,
    SenderAbortedError,
    TransferError,
    UnauthenticatedMessageError,
    WeightSyncError,
)
from weightsync_core.process_group import (
    create_store,
    default_host,
    listen_on_free_port,
    new_gloo_group,
    rendezvous,
)
from weightsync_core.topology import EVERY_LOCAL_ACTOR_RANK, broadcast_topology
from weightsync_core.verification import DeliveryVerifier, Manifest, ManifestEntry
from weightsync_core.wire import MessageCodec, MessageSealer

__all__ = ["CollectiveBroadcastCheckpointEngine"]

_MAX_IN_FLIGHT = 4
"""Messages the sender keeps posted ahead of the receivers."""
_MAX_METADATA_BYTES = 1 << 30


class _BucketMessage(msgspec.Struct, tag="bucket", frozen=True):
    meta: BucketMeta


class _FinalMessage(msgspec.Struct, tag="final", frozen=True):
    manifest: list[ManifestEntry]
    global_steps: int | None


class _AbortMessage(msgspec.Struct, tag="abort", frozen=True):
    reason: str


_Message = _BucketMessage | _FinalMessage | _AbortMessage
_CODEC: MessageCodec[_Message] = MessageCodec(_Message)


@dataclass(frozen=True)
class _Group:
    """One sync's communicators, captured by every transfer so that a thread left over from
    an aborted sync can never post into the next sync's group."""

    control: dist.ProcessGroup
    data: dist.ProcessGroup
    store: dist.Store
    sender: str
    sealer: MessageSealer
    """Seals and opens this sync's metadata (the group may outlive a sync; the key not)."""


class CollectiveBroadcastCheckpointEngine(CheckpointEngine):
    """Broadcast buckets from a sending actor rank to its rollout workers over one group.

    Topology (see :mod:`weightsync_core.topology`): actor rank 0 is group rank 0 (the
    sender), rollout worker ``i`` is group rank ``i + 1``; other actor ranks get rank ``-1``
    and only drain their weight iterator. With ``senders > 1``, relay actor ranks on rank 0's
    host each lead a group of their own share of the rollout workers.

    Args:
        bucket_size: bytes per bucket (two on a sender, up to three on a receiver).
        **kwargs: the options (:class:`~weightsync_core.engines.CollectiveBroadcastOptions`:
            ``host``, ``senders``, ``rebuild_group``, ...) and
            :class:`~weightsync_core.base.CheckpointEngine`'s arguments.
    """

    device_type: ClassVar[str] = "cpu"
    options_class = CollectiveBroadcastOptions
    options: CollectiveBroadcastOptions

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
        self._group: _Group | None = None
        self._group_key: dict[str, Any] | None = None
        self._listener: socket.socket | None = None
        self._healthy = True
        self._send_buffers: list[torch.Tensor] = []
        self.device = self._current_device()
        self._receive_buffers = ReceiveBuffers(self._allocate_bucket)

    # -- hooks for device backends -------------------------------------------------------
    def _current_device(self) -> torch.device:
        """The device this engine uses, fixed at construction (worker threads may have
        another current device)."""
        return resolve_device(self.device_type, type(self).__name__, "backend='gloo'")

    def _allocate_bucket(self) -> torch.Tensor:
        """One bucket buffer on this engine's device."""
        return allocate_bucket(self.bucket_size, self.device)

    def _new_data_group(
        self, store: dist.Store, rank: int, world_size: int, control: dist.ProcessGroup
    ) -> dist.ProcessGroup:
        """The communicator for bucket bytes; by default the gloo control group."""
        return control

    def _synchronize_device(self) -> None:
        """Block until the device's current stream is idle: copies into a bucket are done
        before it is sent, and a collective is done before its bucket is reused or read.
        No-op on host memory."""
        synchronize_device(self.device)

    # -- CheckpointEngine ----------------------------------------------------------------
    def _own_host(self) -> str:
        return self.host or default_host()

    def prepare(self) -> dict[str, Any]:
        host = self._own_host()
        # Listening from now on, on this host only; if this process becomes group rank 0,
        # its store serves this very socket (no other process can take the port meanwhile).
        self._close_listener()
        self._listener = listen_on_free_port(host)
        return {
            "host": host,
            "port": self._listener.getsockname()[1],
            "member": self.member_id,
            "group": self._group_key,
            "senders": self.senders,
        }

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return broadcast_topology(actor_wg_world_size, rollout_world_size, metadata)

    def init_process_group(
        self,
        rank: int,
        world_size: int,
        master_metadata: dict[str, Any] | None,
        members: list[str] | None = None,
    ) -> None:
        listener, self._listener = self._listener, None
        sealer = MessageSealer(self.session_key)
        if rank >= 0 and master_metadata and master_metadata.get("reuse"):
            self._close(listener)
            if self._group is None or self._group_key != {
                "port": master_metadata["port"], "members": members
            }:
                raise WeightSyncError(
                    f"{type(self).__name__}: asked to reuse a group this process does not hold "
                    f"(rank {rank}); the topology and the engine state disagree"
                )
            self._group = dataclasses.replace(self._group, sealer=sealer)
            self.rank, self.world_size = rank, world_size
            return
        self._destroy_group()
        self.rank, self.world_size = rank, world_size
        if rank != 0:
            self._close(listener)  # only group rank 0 serves the store
        if rank < 0:
            return
        store = create_store(
            master_metadata["host"], master_metadata["port"], rank, world_size,
            self.group_init_timeout, f"{self.group_name}/{sealer.derive('rendezvous')}",
            listener=listener,
        )
        rendezvous(store, rank, world_size, self.group_init_timeout)
        control = new_gloo_group(
            dist.PrefixStore("control", store), rank, world_size, self.timeout, self._own_host()
        )
        data = self._new_data_group(dist.PrefixStore("data", store), rank, world_size, control)
        sender = f"actor rank {master_metadata.get('sender', 0)}"
        self._group = _Group(control, data, store, sender, sealer)
        self._group_key = {"port": master_metadata["port"], "members": members}
        self._healthy = True

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
                self._send_buffers = [self._allocate_bucket() for _ in range(2)]
            packer = BucketPacker(
                self._send_buffers, self.rollout_dtype,
                self.bucket_checksum if self.verify else None, self.direct_min_bytes,
            )
            async for bucket in packer.pack(weights):
                self._synchronize_device()
                works = self._post_message(group, _BucketMessage(bucket.meta), bucket.data)
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
            if not packer.num_tensors:
                raise EmptyWeightsError(
                    f"{type(self).__name__} on {group.sender}: the weight stream held no "
                    "tensors; a sync that loads nothing is refused (does iter_weights yield "
                    "anything?)"
                )
            final = _FinalMessage(packer.manifest, global_steps)
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
        unpacker = BucketUnpacker(copy=False)
        verifier = DeliveryVerifier(self.bucket_checksum)
        buffers = self._receive_buffers
        index = 0
        completed = False
        pending: asyncio.Future | None = asyncio.ensure_future(
            self._receive_message(group, buffers.take(index))
        )
        try:
            while True:
                message, data = await pending
                pending = None
                if isinstance(message, _AbortMessage):
                    raise SenderAbortedError(
                        f"{group.sender} aborted the sync, so rollout rank {self.rank} stops: "
                        f"{message.reason}"
                    )
                if isinstance(message, _FinalMessage):
                    verifier.finish(message.manifest, incomplete=unpacker.incomplete())
                    completed = True
                    return
                index += 1
                pending = asyncio.ensure_future(self._receive_message(group, buffers.take(index)))
                if self.verify:
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

    # -- relaying buckets packed elsewhere (kimi feeds a replica's group this way) ------------
    async def relay_bucket(self, meta: BucketMeta, data: torch.Tensor) -> None:
        """Group rank 0: broadcast one already-packed bucket (``data`` = its used bytes, on
        this engine's device); returns once it has left. Receivers run
        :meth:`receive_weights` as usual."""
        await self._relay(_BucketMessage(meta), data)

    async def relay_final(self, manifest: Manifest, global_steps: int | None) -> None:
        """Group rank 0: end a relayed stream with the sender's manifest."""
        await self._relay(_FinalMessage(list(manifest), global_steps))

    async def relay_abort(self, reason: str) -> None:
        """Group rank 0: tell the receivers the relayed stream is off (best effort)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._relay(_AbortMessage(reason)), min(self.timeout, 30.0))

    async def _relay(self, message: _Message, data: torch.Tensor | None = None) -> None:
        group = self._require_group(sender=True)
        if group is None:
            raise WeightSyncError(f"{type(self).__name__}: this rank has no group to relay to")
        try:
            if data is not None:
                self._synchronize_device()
            await run_blocking(self._wait, group, self._post_message(group, message, data))
        except BaseException:
            self._healthy = False
            raise

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
        self._receive_buffers = ReceiveBuffers(self._allocate_bucket)
        self._close_listener()
        self._destroy_group()
        self._release_buffers()

    @staticmethod
    def _close(listener: socket.socket | None) -> None:
        if listener is not None:
            listener.close()

    def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        self._close(listener)


    def _release_buffers(self) -> None:
        if not self.keep_buffers:
            self._send_buffers = []
            self._receive_buffers = ReceiveBuffers(self._allocate_bucket)

    def _destroy_group(self) -> None:
        group, self._group = self._group, None
        self._group_key = None
        self.rank = None
        # Dropping the communicators last: their destructors may wait for transfers still in
        # flight after a failure, and by then this engine's state is already clean.
        del group

    # -- wire protocol -------------------------------------------------------------------
    def _require_group(self, *, sender: bool) -> _Group | None:
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

    def _post(self, group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
        """Enqueue one broadcast from group rank 0 (returns at once)."""
        options = BroadcastOptions()
        options.rootRank = 0
        return group.broadcast([tensor], options)

    def _wait(self, group: _Group, works: list[tuple[dist.Work, str]]) -> None:
        """Block until every posted broadcast completes (on the device too); name the stage
        that failed."""
        for work, stage in works:
            try:
                work.wait()
                self._synchronize_device()
            except RuntimeError as exc:
                peer = "the rollout workers" if self.rank == 0 else group.sender
                raise TransferError(
                    f"{type(self).__name__}: broadcast of {stage} failed on group rank "
                    f"{self.rank} (peer: {peer}): {exc}",
                    peer=peer, stage=stage,
                ) from exc

    def _post_message(
        self, group: _Group, message: _Message, data: torch.Tensor | None = None
    ) -> list[tuple[dist.Work, str]]:
        """Enqueue header, sealed metadata and bucket bytes of one message, in that order."""
        sealed = group.sealer.seal(_CODEC.encode(message))
        meta = torch.frombuffer(bytearray(sealed), dtype=torch.uint8)
        data_len = 0 if data is None else data.numel()
        header = torch.tensor([meta.numel(), data_len], dtype=torch.int64)
        name = type(message).__name__.strip("_").removesuffix("Message").lower()
        works = [
            (self._post(group.control, header), f"{name} header"),
            (self._post(group.control, meta), f"{name} metadata"),
        ]
        if data_len:
            works.append((self._post(group.data, data), "bucket data"))
        return works

    def _receive_message_blocking(
        self, group: _Group, buffer: torch.Tensor
    ) -> tuple[_Message, torch.Tensor]:
        header = torch.zeros(2, dtype=torch.int64)
        self._wait(group, [(self._post(group.control, header), "header")])
        meta_len, data_len = (int(value) for value in header)
        if not 0 < meta_len <= _MAX_METADATA_BYTES:
            raise TransferError(
                f"rollout rank {self.rank} received a malformed message header {header.tolist()}"
                f" from {group.sender}; the group is out of step (a peer from another sync?)",
                peer=group.sender, stage="header",
            )
        if data_len > buffer.numel() or data_len < 0:
            raise TransferError(
                f"{group.sender} announced a {data_len}-byte bucket but rollout rank "
                f"{self.rank} has {buffer.numel()}-byte buckets; use the same "
                "update_weights_bucket_megabytes on both sides",
                peer=group.sender, stage="header",
            )
        meta = torch.empty(meta_len, dtype=torch.uint8)
        data = buffer[:data_len]
        works = [(self._post(group.control, meta), "metadata")]
        if data_len:
            works.append((self._post(group.data, data), "bucket data"))
        self._wait(group, works)
        return self._open(group, meta.numpy().tobytes(), data), data

    def _open(self, group: _Group, frame: bytes, data: torch.Tensor) -> _Message:
        """The message in ``frame``, once its seal and its fit with ``data`` check out."""
        try:
            message = _CODEC.decode(group.sealer.open(frame))
            if isinstance(message, _BucketMessage):
                message.meta.check(data.numel())
                if message.meta.nbytes != data.numel():
                    raise ValueError(
                        f"bucket {message.meta.index} describes {message.meta.nbytes} bytes "
                        f"but {data.numel()} arrived"
                    )
        except (UnauthenticatedMessageError, MalformedMessageError, ValueError) as exc:
            raise TransferError(
                f"rollout rank {self.rank} refused a message from {group.sender}: {exc}",
                peer=group.sender, stage="metadata",
            ) from exc
        return message

    async def _receive_message(
        self, group: _Group, buffer: torch.Tensor
    ) -> tuple[_Message, torch.Tensor]:
        """Receive one message into ``buffer`` on a worker thread (header, then the rest),
        so the event loop stays free to hand out the previous bucket meanwhile."""
        return await run_blocking(self._receive_message_blocking, group, buffer)

    async def _abort(
        self, group: _Group, in_flight: list[asyncio.Future], exc: BaseException
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
            works = self._post_message(group, _AbortMessage(f"{type(exc).__name__}: {exc}"))
            await asyncio.wait_for(run_blocking(self._wait, group, works), timeout=limit)


def _ends_tensor(bucket: PackedBucket) -> bool:
    """True if the bucket holds the last piece of its (first) tensor."""
    meta = bucket.meta.tensors[0]
    return meta.chunk_offset + meta.nbytes == meta.total_nbytes
