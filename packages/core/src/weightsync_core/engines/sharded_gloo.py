"""The ``gloo_sharded`` engine: sharded delivery over gloo point to point. Every rollout
worker receives only the boxes its layout needs, from the actor ranks that hold them, every
actor rank sending at once (see :mod:`weightsync_core.data.shards`)."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch

from weightsync_core.api.config import MAX_BUCKET_MEGABYTES
from weightsync_core.api.engine import TransferStats
from weightsync_core.api.errors import EmptyWeightsError, WeightSyncError
from weightsync_core.api.handshake import Count, Handshake, Port, Text
from weightsync_core.api.hosts import default_host
from weightsync_core.api.options import EngineOptions
from weightsync_core.api.registry import CheckpointEngineRegistry
from weightsync_core.data.bucketing import WeightsSource, iter_named_tensors
from weightsync_core.data.delta.codec import ShareDecoder, ShareEncoder
from weightsync_core.data.shards.exchange import PlanExchange, PointToPoint
from weightsync_core.data.shards.layout import Layout
from weightsync_core.data.shards.patches import SliceDecoder, SliceEncoder
from weightsync_core.data.shards.pieces import PieceDecoder, PieceEncoder, WholePieces
from weightsync_core.data.shards.quantized import ShardQuantizer, travel_weights
from weightsync_core.data.shards.specs import (
    LayoutSpec,
    parse_weights_spec,
    plan_layouts,
    resolve_layout,
    weights_spec,
)
from weightsync_core.data.shards.transfers import TransferPlan
from weightsync_core.data.sync_layout import SyncLayout
from weightsync_core.engines.typed import TypedEngine, decode_metadata, wire_columns
from weightsync_core.net.blocking import run_blocking
from weightsync_core.net.process_group import (
    RendezvousStore,
    create_store,
    listen_on_free_port,
    new_gloo_group,
    rendezvous,
)
from weightsync_core.net.wire import MessageSealer

__all__ = [
    "MAX_CHUNK_MEGABYTES",
    "ShardedArguments",
    "ShardedGlooCheckpointEngine",
    "ShardedGlooOptions",
    "ShardedMetadata",
    "StoreAddress",
]

MAX_CHUNK_MEGABYTES = MAX_BUCKET_MEGABYTES
"""The largest ``chunk_megabytes`` (64 GiB): no message or staging buffer is larger than
the largest bucket."""


@dataclass(frozen=True)
class ShardedGlooOptions(EngineOptions):
    """Options of ``gloo_sharded``.

    Attributes:
        host: address this process binds for the group (default: ``WEIGHTSYNC_HOST``, the
            Ray node IP, or ``127.0.0.1``).
        chunk_megabytes: the largest message (MiB); a larger piece travels in chunks. At
            least one byte (``2**-20``) and at most :data:`MAX_CHUNK_MEGABYTES` (64 GiB, the
            largest bucket).
        group_init_timeout: seconds group set-up may take before failing with the ranks
            that never arrived.
        relay: let workers of different replicas that need the same slices relay them to
            each other (the actor ranks send each slice once), where that lowers the bytes
            of the busiest sender; as set on actor rank 0.
    """

    host: str | None = None
    chunk_megabytes: float = 64.0
    group_init_timeout: float = 60.0
    relay: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 2**-20 <= self.chunk_megabytes <= MAX_CHUNK_MEGABYTES:
            raise ValueError(
                f"option 'chunk_megabytes' must be at least one byte (2**-20 MiB) and at most "
                f"{MAX_CHUNK_MEGABYTES} (64 GiB, the largest bucket), got "
                f"{self.chunk_megabytes!r}: a chunk is the largest message (or one-sided "
                "write) of a piece; the default is 64"
            )
        if not self.group_init_timeout > 0:
            raise ValueError(f"option 'group_init_timeout' must be > 0 seconds, got "
                             f"{self.group_init_timeout}")


class ShardedMetadata(Handshake, frozen=True, kw_only=True):
    """What a process of a sharded sync announces.

    Attributes:
        host: where it is reached.
        port: the port it reserved (actor rank 0 serves the group's store on it).
        layout: what it holds or needs (a :data:`~weightsync_core.data.shards.LayoutSpec`;
            None: every tensor whole).
        weights: on actor rank 0, every tensor's shape and dtype as it travels
            (:func:`~weightsync_core.data.shards.weights_spec` of
            :func:`~weightsync_core.data.shards.quantized.travel_weights`: cast to the
            rollout dtype, or quantized, each quantized weight followed by its scales).
        relay: whether workers of different replicas may relay slices to each other (as
            actor rank 0's options say).
    """

    host: Text
    port: Port
    layout: dict[str, Any] | None = None
    weights: dict[str, Any] | None = None
    relay: bool = True


class StoreAddress(Handshake, frozen=True, kw_only=True):
    """Where a sharded sync's group meets: actor rank 0's store."""

    host: Text
    port: Port


class ShardedArguments(Handshake, frozen=True, kw_only=True):
    """One process's part in a sharded sync (what ``init_process_group`` takes).

    Attributes:
        rank: its rank in the group (actor ranks first, then the rollout workers).
        world_size: every actor rank and rollout worker.
        master: where the group meets.
        plan: the transfer plan, as plain data (:meth:`TransferPlan.as_data`).
        weights: every tensor's shape and dtype as it travels, as actor rank 0 announced
            them.
        actor_ranks: how many of the group's ranks are actor ranks.
    """

    rank: int
    world_size: Count
    master: StoreAddress
    plan: list[list[Any]]
    weights: dict[str, Any]
    actor_ranks: Count


@dataclass
class _Sync:
    """One sync's group and plan."""

    store: RendezvousStore
    exchange: PlanExchange
    layout: Layout
    rank: int
    """This process's rank among the actor ranks or the rollout workers."""
    is_actor: bool


@CheckpointEngineRegistry.register("gloo_sharded")
class ShardedGlooCheckpointEngine(TypedEngine[ShardedMetadata, ShardedArguments]):
    """Sharded delivery over one gloo group of every actor rank and rollout worker.

    Each process declares its layout before ``prepare()``
    (:meth:`declare_layout`: what an actor rank holds, say its FSDP rows, and, on actor rank 0,
    every tensor's shape and dtype; what a rollout worker needs, say its tensor-parallel
    slices; nothing declared: every tensor whole). :meth:`build_topology` intersects them
    into a :class:`~weightsync_core.data.shards.TransferPlan`; every process checks it holds the
    same plan, then every actor rank sends its pieces point to point while every worker
    receives exactly the boxes it declared, each piece checked against its sender's
    checksum; workers of different replicas that need the same slices relay them to each
    other as they arrive (option ``relay``). Workers yield ``(name, box)`` tensors of the
    shape of their box.

    In a delta sync (``delta=True``) every actor rank keeps a copy of its own shard and
    sends each piece as a patch against it, and every worker keeps a copy of its own boxes
    and patches it piece by piece (see :mod:`weightsync_core.data.shards.patches`).

    Quantized on send (``rollout_quantization``, which the actor ranks pass to
    :meth:`declare_layout`): every actor rank quantizes its own rows, one scale per block
    agreed between the ranks that hold its rows, and each worker gets the scales of the
    blocks its slices touch (see :mod:`weightsync_core.data.shards.quantized`).
    """

    options_class = ShardedGlooOptions
    executes_layouts: ClassVar[bool] = True
    supports_delta: ClassVar[bool] = True
    encodes_own_share: ClassVar[bool] = True
    decodes_own_pieces: ClassVar[bool] = True
    quantizes_shards: ClassVar[bool] = True
    """The actor ranks hand it their weights unquantized: it quantizes each rank's rows."""
    metadata_type = ShardedMetadata
    arguments_type = ShardedArguments
    family = "sharded sync"

    def __init__(self, bucket_size: int, **kwargs: Any) -> None:
        super().__init__(bucket_size, **kwargs)
        self.host = self.options.host
        self.layout_spec: LayoutSpec | None = None
        self.weights_spec: dict[str, Any] | None = None
        """On an actor rank, every tensor's shape and dtype as it travels in this sync."""
        self._listener: socket.socket | None = None
        self._sync: _Sync | None = None

    def declare_layout(self, layout: LayoutSpec | None,
                       weights: Mapping[str, Any] | None = None,
                       quantization: str | None = None) -> None:
        """What this process holds or needs (a :data:`~weightsync_core.data.shards.LayoutSpec`;
        None: every tensor whole) and, on an actor rank, every tensor's shape and dtype
        (:func:`~weightsync_core.data.shards.weights_spec`) before the rollout cast, and
        the format this sync's weights are quantized to (``rollout_quantization``; None:
        not quantized).

        Raises:
            ValueError: a quantization format that is not known.
        """
        self.layout_spec = layout
        self.weights_spec = None
        if weights is not None:
            shapes, dtypes = travel_weights(*parse_weights_spec(weights), self.rollout_dtype,
                                            quantization)
            self.weights_spec = weights_spec({name: (shape, dtypes[name])
                                              for name, shape in shapes.items()})

    # -- CheckpointEngine ----------------------------------------------------------------
    def announce(self) -> ShardedMetadata:
        """Reserve a port and say what this process holds or needs."""
        host = self.host or default_host()
        self._close_listener()
        self._listener = listen_on_free_port(host)
        return ShardedMetadata(
            host=host, port=self._listener.getsockname()[1],
            layout=None if self.layout_spec is None else dict(self.layout_spec),
            weights=self.weights_spec,
            relay=self.options.relay,
        )

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """The plan, from every process's layout and actor rank 0's weights (relayed
        between replicas where actor rank 0's options allow it and it is cheaper); the
        replicas not known, every worker together must need the whole model."""
        layout = cls.sync_layout(actor_wg_world_size, [1] * rollout_world_size)
        actor, rollout = cls._plan(layout, decode_metadata(layout, metadata, ShardedMetadata),
                                   known_replicas=False)
        return wire_columns(actor, ShardedArguments), wire_columns(rollout, ShardedArguments)

    @classmethod
    def plan(
        cls, layout: SyncLayout, metadata: list[ShardedMetadata]
    ) -> tuple[list[ShardedArguments], list[ShardedArguments]]:
        """:meth:`build_topology`, every replica's workers together needing the whole model,
        workers named as the manager names them (see
        :func:`~weightsync_core.data.shards.plan_layouts`)."""
        return cls._plan(layout, metadata, known_replicas=True)

    @classmethod
    def _plan(
        cls, layout: SyncLayout, metadata: list[ShardedMetadata], *, known_replicas: bool
    ) -> tuple[list[ShardedArguments], list[ShardedArguments]]:
        head = metadata[0]
        if not head.weights:
            raise WeightSyncError(
                "gloo_sharded: actor rank 0 declared no weights (their shapes and dtypes): "
                "the actor must implement weight_shapes()")
        shapes, dtypes = parse_weights_spec(head.weights)
        itemsizes = {name: dtype.itemsize for name, dtype in dtypes.items()}
        actor_ranks = layout.actor_ranks
        plan = plan_layouts(shapes, [entry.layout for entry in metadata], actor_ranks,
                            layout.replica_workers if known_replicas else None, itemsizes,
                            relay=head.relay).as_data()
        master = StoreAddress(host=head.host, port=head.port)
        arguments = [ShardedArguments(rank=rank, world_size=layout.world_size, master=master,
                                      plan=plan, weights=head.weights, actor_ranks=actor_ranks)
                     for rank in range(layout.world_size)]
        return arguments[:actor_ranks], arguments[actor_ranks:]

    def join(self, arguments: ShardedArguments) -> None:
        """Meet every other process at actor rank 0's store, agree the plan, and get ready to
        carry this process's pieces."""
        self._end_sync()
        rank, world_size = arguments.rank, arguments.world_size
        listener, self._listener = self._listener, None
        if rank != 0 and listener is not None:
            listener.close()
            listener = None
        sealer = MessageSealer(self.session_key)
        key = sealer.derive_key("rendezvous store")
        timeout = self.options.group_init_timeout
        store = create_store(arguments.master.host, arguments.master.port, rank, world_size,
                             timeout, "gloo_sharded", key, listener=listener)
        try:
            rendezvous(store, rank, world_size, timeout)
            group = cast(PointToPoint, new_gloo_group(store.store, rank, world_size,
                                                      self.timeout, self.host or default_host()))
            shapes, dtypes = parse_weights_spec(arguments.weights)
            exchange = PlanExchange(group, TransferPlan.from_data(arguments.plan), shapes,
                                    dtypes, arguments.actor_ranks, sealer,
                                    int(self.options.chunk_megabytes * 2**20), self.timeout,
                                    lambda data: self.bucket_checksum(data))
            is_actor = rank < arguments.actor_ranks
            own = rank if is_actor else rank - arguments.actor_ranks
            who = f"{'actor' if is_actor else 'rollout'} rank {own}"
            layout = resolve_layout(self.layout_spec, shapes, who, holds=is_actor)
            exchange.agree(rank, world_size)
            self.carry(exchange, rank)
        except BaseException:
            store.close()
            raise
        self._sync = _Sync(store, exchange, layout, own, is_actor)

    def carry(self, exchange: PlanExchange, group_rank: int) -> None:
        """Override point: how the pieces' bytes travel, set on ``exchange`` after every
        process agreed on the plan (a collective of the group; default: gloo messages)."""

    def sends_weights(self) -> bool:
        """Every actor rank sends the rows it holds."""
        return self._sync is not None and self._sync.is_actor

    async def send_weights(
        self, weights: WeightsSource, global_steps: int | None = None
    ) -> TransferStats:
        start = time.perf_counter()
        sync = self._require_sync()
        encoder = self._piece_encoder(sync.rank)
        sender = sync.exchange.sender(sync.rank, sync.layout, encoder)
        quantizer = ShardQuantizer(sync.exchange, sync.rank, sync.layout, self.rollout_dtype,
                                   self.passes)
        tensors = 0
        async for name, shard in iter_named_tensors(weights):
            for travelling in quantizer.convert(name, shard):
                await run_blocking(sender.put, *travelling)
            tensors += 1
        quantizer.finish()
        if not tensors and sync.layout.boxes:
            raise EmptyWeightsError(
                f"{type(self).__name__} on actor rank {sync.rank}: the weight stream held no "
                "tensors; a sync that loads nothing is refused")
        nbytes = await run_blocking(sender.finish)
        if isinstance(encoder, SliceEncoder):
            encoder.end()
        # its "buckets" are the data messages (chunks) it sent
        return TransferStats(tensors, nbytes, sender.messages, time.perf_counter() - start)

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield each tensor's box as this worker's layout declared it, whole and checked."""
        sync = self._require_sync()
        decoder = self._piece_decoder(sync.rank)
        received = sync.exchange.receive(sync.rank, sync.layout, decoder)
        while (item := await run_blocking(_next_or_none, received)) is not None:
            yield item
        if isinstance(decoder, SliceDecoder):
            decoder.end()

    def finalize(self) -> None:
        """End this sync (the group is built afresh every sync)."""
        self._end_sync()

    def abort(self) -> None:
        """Drop the group and the reserved port, whatever their state."""
        self._close_listener()
        self._end_sync()

    # -- helpers ---------------------------------------------------------------------------
    def _piece_encoder(self, rank: int) -> PieceEncoder:
        """How actor rank ``rank`` sends its pieces: as the worker's delta sender says
        (:attr:`share_encoder`), else whole."""
        share = self.share_encoder
        if not isinstance(share, ShareEncoder):
            return WholePieces()
        if share.plan is None or not share.sending:
            share.sender.skip(share.plan)
            return WholePieces()
        return SliceEncoder(share.sender, share.plan, f"actor rank {rank}")

    def _piece_decoder(self, rank: int) -> PieceDecoder:
        """How rollout rank ``rank`` builds its boxes: as the worker's delta receiver says
        (:attr:`share_decoder`), else from the pieces as they are."""
        share = self.share_decoder
        if not isinstance(share, ShareDecoder):
            return WholePieces()
        if share.plan is None:
            share.receiver.forget()
            return WholePieces()
        return SliceDecoder(share.receiver, share.plan, f"rollout rank {rank}")

    def _require_sync(self) -> _Sync:
        if self._sync is None:
            raise WeightSyncError(f"{type(self).__name__}: no group (did init_process_group "
                                  "fail?)")
        return self._sync

    def _end_sync(self) -> None:
        sync, self._sync = self._sync, None
        if sync is not None:
            sync.store.close()

    def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()


def _next_or_none(items: Iterator[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor] | None:
    """The next item of ``items``, or None at its end."""
    return next(items, None)
