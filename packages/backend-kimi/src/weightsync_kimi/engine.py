"""The ``kimi`` engine: every actor rank serves its share from host memory; one leader per
replica pulls the buckets peer-to-peer over Mooncake and relays them to the rest of its
replica over a collective broadcast (Moonshot's checkpoint-engine pattern, which verl wraps
as ``kimi_ckpt_engine``).

1. Each actor rank packs the tensors it owns (:class:`~weightsync_kimi.shares.ShareAssigner`)
   into host buckets registered with the Transfer Engine, kept until the next update, and
   sends a :class:`~weightsync_kimi.shares.ShareManifest` to every replica's leader.
2. A leader pulls the buckets of all owners, interleaved, double-buffered: the pull of bucket
   ``k+1`` overlaps the broadcast of bucket ``k`` to the replica and its own server's read
   (on host memory the broadcast reads the bytes the server is handed, which the server may
   change as it loads them: there it ends before the server reads).
3. :meth:`KimiCheckpointEngine.get_weights` runs step 2 from the shares the owners still
   hold, so a replica added later gets the latest weights while the actor ranks send nothing.

In a delta sync each actor rank diffs only its own share, and keeps a copy of that share
only (``encodes_own_share``); shares of patches are no cache for a replica added later.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, cast

import torch

from weightsync_core.spi import (
    BucketMeta,
    BucketPacker,
    BucketUnpacker,
    CheckpointEngineRegistry,
    CheckpointEngineWithCache,
    ControlChannel,
    DeliveryVerifier,
    EmptyWeightsError,
    PeerEndpoints,
    ReceiveBuffers,
    RemoteBuffer,
    SyncLayout,
    TransferError,
    TransferStats,
    TypedEngine,
    WeightsSource,
    WeightSyncError,
    allocate_bucket,
    copy_bytes,
    default_host,
    iter_named_tensors,
    run_blocking,
)
from weightsync_kimi.options import KimiOptions
from weightsync_kimi.shares import ShareAssigner, ShareManifest, ShareMessage, rollout_nbytes
from weightsync_kimi.topology import KimiMetadata, KimiPlan, plan_kimi
from weightsync_mooncake.transport import MooncakeTransport

__all__ = ["KimiCheckpointEngine"]


@CheckpointEngineRegistry.register("kimi_ckpt_engine")
@CheckpointEngineRegistry.register("kimi")
class KimiCheckpointEngine(TypedEngine[KimiMetadata, KimiPlan], CheckpointEngineWithCache):
    """Actor ranks serve shares from host memory; replica leaders pull, then broadcast.

    Options: :class:`~weightsync_kimi.options.KimiOptions` (``protocol``, ``collective``,
    ``collective_kwargs``, ...), given as ``engine_kwargs={"kimi": {...}}``.
    """

    options_class = KimiOptions
    metadata_type = KimiMetadata
    arguments_type = KimiPlan
    family = "kimi sync"
    supports_delta = True
    encodes_own_share = True
    host_buckets = 5
    """A replica leader's two pull slots and up to three copies (owners hold their share)."""
    # options_class makes it a KimiOptions; core declares the base attribute mutable, so
    # narrowing it is reported although nothing assigns another type.
    options: KimiOptions

    def __init__(self, bucket_size: int, **kwargs: Any) -> None:
        super().__init__(bucket_size, **kwargs)
        options = self.options
        self.protocol = options.protocol
        self.device_name = options.device_name
        self.host = host = options.host
        self.collective = options.collective
        self.keep_buffers = options.keep_buffers and not options.rebuild_group
        self.rebuild_group = options.rebuild_group
        self._inner = options.collective_class()(
            bucket_size, verify=self.verify, timeout=self.timeout, host=host,
            **{"rebuild_group": options.rebuild_group, **options.collective_kwargs},
        )
        self._endpoints = PeerEndpoints(host, self._open_transport, ShareMessage)
        self._plan: KimiPlan | None = None
        self._pinned = torch.cuda.is_available()
        self._cache: ShareManifest | None = None
        self._cache_buffers: list[torch.Tensor] = []
        self._cache_descriptors: list[RemoteBuffer] = []
        self._slots: list[torch.Tensor] = []
        self._copies = ReceiveBuffers(self._allocate_copy)
        """Where a leader copies each pulled bucket before checking it: what its server and
        its replica read is what was verified, whatever a peer writes into the registered
        slots meanwhile (Mooncake lets anyone who reaches it write there)."""

    # -- set-up --------------------------------------------------------------------------
    def _open_transport(self) -> MooncakeTransport:
        return MooncakeTransport(self.host or default_host(), self.protocol, self.device_name)

    @property
    def transport(self) -> MooncakeTransport:
        """This process's Transfer Engine (created on first use)."""
        # PeerEndpoints is not generic in its transport: this one builds MooncakeTransport
        return cast(MooncakeTransport, self._endpoints.transport)

    @property
    def channel(self) -> ControlChannel[ShareMessage]:
        """This process's control channel (bound on first use)."""
        return self._endpoints.channel

    def set_session_key(self, key: bytes) -> None:
        """Take this sync's key, for the shares and for the replica's broadcast group."""
        super().set_session_key(key)
        self._inner.set_session_key(key)

    def announce(self) -> KimiMetadata:
        """This process's channel and transport, the share it holds, and its replica
        group's own metadata."""
        return KimiMetadata(
            endpoint=self.channel.endpoint, peer=self.transport.metadata(), cache=self._cache,
            collective=self.collective, inner=self._inner.prepare(),
        )

    @classmethod
    def plan(
        cls, layout: SyncLayout, metadata: list[KimiMetadata]
    ) -> tuple[list[KimiPlan], list[KimiPlan]]:
        """Owners, one leader per replica, members (:func:`~weightsync_kimi.topology.plan_kimi`;
        without the replica layout, every rollout worker pulls for itself)."""
        return plan_kimi(layout, metadata)

    def join(self, arguments: KimiPlan) -> None:
        """Take this sync's key and part, joining the replica's broadcast group."""
        self.channel.use_key(self.session_key)
        self._plan = arguments
        if arguments.inner is not None:  # arguments.has_replica_group
            self._inner.init_process_group(**arguments.inner)
        if arguments.role == "leader" and not self._slots:
            self._slots = [self._register(self._allocate()) for _ in range(2)]

    # -- actor side ----------------------------------------------------------------------
    async def send_weights(
        self, weights: WeightsSource, global_steps: int | None = None
    ) -> TransferStats:
        start = time.perf_counter()
        plan = self._require("owner", "send_weights")
        rank = plan.rank
        assigner = ShareAssigner(plan.world_size)
        totals = {"bytes": 0, "tensors": 0}

        async def own_share() -> AsyncIterator[tuple[str, torch.Tensor]]:
            async for name, tensor in iter_named_tensors(weights):
                nbytes = rollout_nbytes(tensor, self.rollout_dtype)
                totals["bytes"] += nbytes
                totals["tensors"] += 1
                if assigner.owner(nbytes) == rank:
                    yield name, tensor

        self._cache = None  # the buffers are being rewritten
        packer = BucketPacker(
            self._cache_buffers, self.rollout_dtype,
            self.bucket_checksum if self.verify else None, grow=self._new_cache_buffer,
            passes=self.passes, hash_while_packing=self.hashes_on_host(torch.device("cpu")),
        )
        encoder = self.share_encoder
        share = own_share() if encoder is None else encoder(own_share())
        buckets = []
        async for bucket in packer.pack(share):
            if bucket.meta.tensors:
                buffer = self._cache_descriptors[len(buckets)]
                buckets.append((bucket.meta, buffer.at(0, bucket.meta.nbytes)))
        if not totals["tensors"]:
            raise EmptyWeightsError(
                f"kimi actor rank {rank}: the weight stream held no tensors; a sync that loads "
                "nothing is refused (does iter_weights yield anything?)"
            )
        share = ShareManifest(
            rank, self.transport.metadata(), plan.sync_id, buckets, packer.manifest,
            global_steps, patches=encoder is not None and encoder.sends_patches,
        )
        message = ShareMessage(plan.sync_id, share)
        for leader in plan.leaders:
            try:
                await self.channel.send(leader, message, self.timeout)
            except TimeoutError as exc:
                raise TransferError(
                    f"kimi actor rank {rank} could not reach a replica leader at {leader} "
                    f"within {self.timeout:.0f}s to publish its share",
                    peer=leader, stage="publishing share",
                ) from exc
        self._cache = share
        return TransferStats(
            totals["tensors"], totals["bytes"], len(buckets), time.perf_counter() - start
        )

    # -- rollout side --------------------------------------------------------------------
    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        plan = self._require(("leader", "member"), "receive_weights")
        if plan.role == "member":
            async for item in self._inner.receive_weights(global_steps):
                yield item
            return
        shares = await self._collect_shares(plan)
        async for item in self._pull_and_relay(shares, global_steps):
            yield item

    async def get_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Load the shares the actor ranks hold from the last update (nothing is sent)."""
        plan = self._require(("leader", "member"), "get_weights")
        if plan.role == "member":
            async for item in self._inner.receive_weights():
                yield item
            return
        cached = [owner.cache for owner in plan.owners]
        missing = [rank for rank, share in enumerate(cached) if share is None]
        shares = [share for share in cached if share is not None]  # all of them unless missing
        error = None
        if missing:
            error = (f"actor rank(s) {missing} hold no cached weights; run update_weights "
                     "before update_replicas_from_cache")
        elif len({share.update_id for share in shares}) != 1:
            error = "the actor ranks hold shares of different updates (one failed part-way)"
        elif any(share.patches for share in shares):
            error = ("the last update sent patches (delta sync), which only replicas holding "
                     "the version before can apply; a replica added since gets whole tensors "
                     "from the next update_weights")
        if error is not None:
            await self._abort_members(error)
            raise WeightSyncError(f"kimi: {error}")
        async for item in self._pull_and_relay(shares, shares[0].global_steps):
            yield item

    def finalize(self) -> None:
        """End this sync: the replica group stays for reuse; the actor ranks keep their share
        (the cache) until the next update; the leader's pull buffers are released unless
        ``keep_buffers``, and scrubbed if kept (registered memory holds no weights between
        syncs, the owners' cached shares aside)."""
        plan, self._plan = self._plan, None
        if plan is not None and plan.has_replica_group:
            self._inner.finalize()
        if not self.keep_buffers:
            self._release_slots()
        for slot in self._slots:
            slot.zero_()

    def abort(self) -> None:
        """After a failed sync: drop the replica group and the pull buffers. A share whose
        update failed part-way is not offered as a cache."""
        self._plan = None
        self._inner.abort()
        self._release_slots()

    def close(self) -> None:
        """Release everything, the cached share and the Transfer Engine included."""
        self.abort()
        self._cache = None
        for buffer in self._cache_buffers:
            with contextlib.suppress(Exception):
                self.transport.deregister(buffer)
        self._cache_buffers, self._cache_descriptors = [], []
        self._endpoints.close()

    # -- internals -----------------------------------------------------------------------
    def _require(self, roles: str | tuple[str, ...], method: str) -> KimiPlan:
        plan = self._plan
        roles = (roles,) if isinstance(roles, str) else roles
        if plan is None:
            raise WeightSyncError(f"kimi: init_process_group must run before {method}")
        if plan.role not in roles:
            raise WeightSyncError(f"kimi: a {plan.role} process cannot {method}")
        return plan

    def _allocate(self) -> torch.Tensor:
        buffer = allocate_bucket(self.bucket_size, torch.device("cpu"))
        return buffer.pin_memory() if self._pinned else buffer

    def _allocate_copy(self, nbytes: int) -> torch.Tensor:
        """A buffer a leader copies one pulled bucket of ``nbytes`` into (filled whole)."""
        buffer = allocate_bucket(nbytes, torch.device("cpu"), mapped=False)
        return buffer.pin_memory() if self._pinned else buffer

    def _register(self, buffer: torch.Tensor) -> torch.Tensor:
        self.transport.register(buffer)
        return buffer

    def _new_cache_buffer(self) -> torch.Tensor:
        """One more registered share buffer (the packer appends it to ``_cache_buffers``)."""
        buffer = self._allocate()
        self._cache_descriptors.append(self.transport.register(buffer))
        return buffer

    def _release_slots(self) -> None:
        self._copies = ReceiveBuffers(self._allocate_copy)
        slots, self._slots = self._slots, []
        for slot in slots:
            with contextlib.suppress(Exception):
                self.transport.deregister(slot)

    async def _collect_shares(self, plan: KimiPlan) -> list[ShareManifest]:
        """Wait for every actor rank's share of this sync."""
        owners = len(plan.owners)
        shares: dict[int, ShareManifest] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while len(shares) < owners:
            try:
                message = await self.channel.receive(max(deadline - loop.time(), 0.0))
            except TimeoutError as exc:
                missing = sorted(set(range(owners)) - set(shares))
                error = TransferError(
                    f"kimi replica leader waited {self.timeout:.0f}s for the shares of actor "
                    f"rank(s) {missing}", peer=f"actor rank {missing[0]}",
                    stage="waiting for shares",
                )
                await self._abort_members(str(error))
                raise error from exc
            share = message.share
            if message.sync == plan.sync_id and 0 <= share.owner < owners:
                shares[share.owner] = share
        return [shares[rank] for rank in range(owners)]

    async def _pull(
        self, share: ShareManifest, meta: BucketMeta, remote: RemoteBuffer, slot: torch.Tensor
    ) -> torch.Tensor:
        """Read one bucket of ``share`` into ``slot``; returns its used bytes."""
        stage = f"pulling bucket {meta.index} of actor rank {share.owner}"
        try:
            meta.check(slot.numel())
            if remote.nbytes != meta.nbytes:
                raise ValueError(f"its buffer holds {remote.nbytes} bytes, not {meta.nbytes}")
        except ValueError as exc:
            raise TransferError(
                f"kimi replica leader: actor rank {share.owner} published a bucket that does "
                f"not fit: {exc}", peer=f"actor rank {share.owner}", stage=stage,
            ) from exc
        data = slot[: meta.nbytes]
        peer = self.transport.connect(share.peer)
        try:
            await asyncio.wait_for(
                run_blocking(self.transport.read, peer, data, remote, self.timeout),
                self.timeout + 5,
            )
        except TimeoutError as exc:
            raise TransferError(
                f"kimi replica leader: {stage} took over {self.timeout:.0f}s",
                peer=f"actor rank {share.owner}", stage=stage,
            ) from exc
        except TransferError as exc:
            raise TransferError(
                f"kimi replica leader: {stage} ({share.peer}) failed: {exc}",
                peer=f"actor rank {share.owner}", stage=stage, code=exc.code,
            ) from exc
        return data

    async def _pull_and_relay(
        self, shares: list[ShareManifest], global_steps: int | None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Pull every bucket (owners interleaved) into two alternating slots; relay each to
        the replica while yielding copies of its tensors to this worker's server."""
        plan = self._require("leader", "pull the weights")
        relay = self._inner if plan.has_replica_group else None
        order = [  # owners interleaved: bucket 0 of every owner, then bucket 1, ...
            (share, *share.buckets[index])
            for index in range(max(len(share.buckets) for share in shares))
            for share in shares if index < len(share.buckets)
        ]
        manifest = [entry for share in shares for entry in share.tensors]
        verifier = DeliveryVerifier(self.bucket_checksum)
        unpacker = BucketUnpacker(copy=False)  # views of the copies, never reused while viewed
        relays: deque[asyncio.Task[None]] = deque()
        pending: asyncio.Task[torch.Tensor] | None = None
        try:
            if order:
                pending = asyncio.ensure_future(self._pull(*order[0], self._slots[0]))
            for k, (share, meta, _) in enumerate(order):
                if pending is None:  # started before its turn, by the previous iteration
                    raise WeightSyncError(f"kimi: the pull of bucket {k} was never started")
                pulled = await pending
                pending = None
                data = self._copies.take(k, meta.nbytes)[: meta.nbytes]
                checksum = None  # of the copy, taken as it is made where the checksum allows
                if self.verify and meta.checksum is not None:
                    with self.passes.timed("copy_out_checksum"):
                        checksum = await run_blocking(self.copy_with_checksum, data, pulled)
                if checksum is None:
                    with self.passes.timed("copy_out"):
                        await copy_bytes(data, pulled)
                del pulled
                # the next pull reuses the slot of bucket k-1: its relay must be done
                while relays:
                    await relays.popleft()
                if k + 1 < len(order):
                    pending = asyncio.ensure_future(
                        self._pull(*order[k + 1], self._slots[(k + 1) % 2])
                    )
                if checksum is not None:
                    verifier.check_checksum(checksum, meta, source=f"actor rank {share.owner}")
                elif self.verify:
                    with self.passes.timed("receiver_checksum"):
                        verifier.check_bucket(data, meta, source=f"actor rank {share.owner}")
                if relay is not None:
                    relayed = data.to(relay.device)
                    relaying = asyncio.ensure_future(relay.relay_bucket(meta, relayed))
                    if relayed.data_ptr() == data.data_ptr():
                        # the server owns what it is given and may change it as it loads:
                        # the replica gets these very bytes first
                        await relaying
                    else:
                        relays.append(relaying)
                for item in unpacker.unpack(data, meta):
                    verifier.record(*item)
                    yield item
            while relays:
                await relays.popleft()
            verifier.finish(manifest, incomplete=unpacker.incomplete())
            if relay is not None:
                await relay.relay_final(manifest, global_steps)
        except BaseException as exc:
            for task in [*relays, *([pending] if pending else [])]:
                task.cancel()
            await self._abort_members(f"{type(exc).__name__}: {exc}")
            raise

    async def _abort_members(self, reason: str) -> None:
        """Tell this replica's other workers the sync is off (best effort)."""
        if self._plan is not None and self._plan.has_replica_group:
            await self._inner.relay_abort(f"the replica leader stopped: {reason}")
