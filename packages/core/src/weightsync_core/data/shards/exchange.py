"""One process's part of a transfer plan, moved point to point over a gloo group: every
actor rank sends the pieces of the rows it holds, every rollout worker receives exactly
the boxes it declared (and forwards the pieces the plan has it relay), each piece checked
against its sender's checksum, which travels sealed under the sync's key (a peer that
races a gloo connection can make the sync fail, never succeed with other bytes)."""

from __future__ import annotations

import struct
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Protocol

import torch
from torch.distributed.distributed_c10d import Work

from weightsync_core.api.checksums import host_checksum
from weightsync_core.api.errors import (
    TransferError,
    UnauthenticatedMessageError,
    VerificationError,
)
from weightsync_core.data.shards.box import Box
from weightsync_core.data.shards.layout import Layout, Shapes
from weightsync_core.data.shards.pieces import (
    PieceDecoder,
    PieceEncoder,
    WholePieces,
    piece_capacity,
)
from weightsync_core.data.shards.transfers import Transfer, TransferPlan
from weightsync_core.net.wire import MessageSealer

__all__ = ["PieceCarrier", "PlanExchange", "PlanSender", "PointToPoint"]

_IN_FLIGHT_BYTES = 256 << 20  # a sender waits for its sends once this much is posted
_CHECKSUM = struct.Struct("<16sQQQ")  # the plan's digest, the piece's index, bytes, xxh3




class PointToPoint(Protocol):
    """What the exchange calls on its group (a ``ProcessGroupGloo``)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> Work:
        """Post a send of ``tensors[0]`` to group rank ``dst``."""
        ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> Work:
        """Post a receive into ``tensors[0]`` from group rank ``src``."""
        ...

    def allgather(self, output: list[list[torch.Tensor]], input: list[torch.Tensor], /
                  ) -> Work:
        """Post an all-gather."""
        ...


class PieceCarrier(Protocol):
    """How the bytes of a plan's pieces travel; their sealed checksums always travel on the
    exchange's gloo group, after the bytes (:class:`PlanExchange` uses gloo messages unless
    given another carrier, such as one-sided writes into the receivers' registered
    memory). A piece takes at most its transfer's :meth:`PlanExchange.capacity` bytes (a
    patch's length is known to its sender only)."""

    def messages(self, exchange: PlanExchange, nbytes: int) -> int:
        """Gloo messages (tags) a piece of at most ``nbytes`` bytes takes, its checksum not
        counted."""
        ...

    def send_piece(self, exchange: PlanExchange, index: int, transfer: Transfer,
                   data: torch.Tensor, tag: int) -> list[Work]:
        """Send the plan's ``index``-th piece, ``data`` (bytes), starting at gloo ``tag``;
        returns the sends still in flight. Its checksum is sent once this returns: bytes
        that do not travel as gloo messages must have landed by then."""
        ...

    def receive_piece(self, exchange: PlanExchange, index: int, transfer: Transfer,
                      tag: int) -> tuple[torch.Tensor | None, list[Work]]:
        """Post the receives of the plan's ``index``-th piece: the tensor it lands in (of
        its capacity) and the receives, or ``(None, [])`` where its bytes are found once
        its checksum arrived (:meth:`collect`)."""
        ...

    def forward_piece(self, exchange: PlanExchange, index: int, transfer: Transfer,
                      received: int, data: torch.Tensor, tag: int) -> list[Work]:
        """On a relaying worker: send the plan's ``index``-th piece (relayed), which is the
        ``received``-th piece, checked and held in ``data``, as :meth:`send_piece` does."""
        ...

    def collect(self, exchange: PlanExchange, index: int, transfer: Transfer,
                received: torch.Tensor | None, nbytes: int) -> torch.Tensor:
        """After the piece's receives and its checksum (which says it is ``nbytes`` long,
        at most its capacity) arrived: its bytes (``received``, what
        :meth:`receive_piece` returned, or a copy out of memory peers can write), checked
        after this."""
        ...


class GlooCarrier:
    """Pieces as gloo messages of at most the exchange's ``chunk_bytes`` each: a piece takes
    as many as its capacity would (the last ones empty where it is shorter), each received
    into its part of a buffer of that capacity (gloo takes a message shorter than its
    buffer, never a longer one); its sealed checksum says how many bytes it was."""

    def messages(self, exchange: PlanExchange, nbytes: int) -> int:
        return exchange.chunks(nbytes)

    def send_piece(self, exchange: PlanExchange, index: int, transfer: Transfer,
                   data: torch.Tensor, tag: int) -> list[Work]:
        peer = exchange.actor_ranks + transfer.receiver
        receiver = f"rollout rank {transfer.receiver}"
        step = exchange.chunk_bytes
        return [exchange.post(exchange.group.send, data[message * step:(message + 1) * step],
                              peer, tag + message, receiver, "sending")
                for message in range(exchange.chunks(exchange.capacity(transfer)))]

    def receive_piece(self, exchange: PlanExchange, index: int, transfer: Transfer,
                      tag: int) -> tuple[torch.Tensor | None, list[Work]]:
        source, peer = exchange.source_rank(transfer), transfer.source
        capacity = exchange.capacity(transfer)
        data = torch.empty(capacity, dtype=torch.uint8)
        step = exchange.chunk_bytes
        return data, [exchange.post(exchange.group.recv,
                                    data[message * step:(message + 1) * step], source,
                                    tag + message, peer, "receiving")
                      for message in range(exchange.chunks(capacity))]

    def forward_piece(self, exchange: PlanExchange, index: int, transfer: Transfer,
                      received: int, data: torch.Tensor, tag: int) -> list[Work]:
        return self.send_piece(exchange, index, transfer, data, tag)

    def collect(self, exchange: PlanExchange, index: int, transfer: Transfer,
                received: torch.Tensor | None, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer the messages were received into."""
        if received is None:
            raise exchange.corrupt(index, transfer, "no buffer was posted for it")
        return received[:nbytes]


class PlanExchange:
    """Moves ``plan`` over ``group``, whose ranks are the actor ranks (``0 .. actor_ranks -
    1``) then the rollout workers (rollout rank ``r`` is group rank ``actor_ranks + r``).

    Every process builds the same plan (check with :meth:`agree`); an actor rank then calls
    :meth:`send` with its shards, a rollout worker iterates :meth:`receive` (which also
    forwards the pieces the plan has it relay, each once it arrived and was checked). A piece larger
    than ``chunk_bytes`` travels in chunks; each piece is followed by its checksum (xxh3,
    with the plan's digest and the piece's index, sealed by ``sealer``), which the receiver
    opens and checks before the piece is placed. The bytes travel as gloo messages unless
    :meth:`use_carrier` names another :class:`PieceCarrier`.

    Args:
        group: the gloo group.
        plan: the sync's plan.
        shapes: every tensor's full shape, in stream order.
        dtypes: every tensor's dtype (as it travels).
        actor_ranks: actor ranks in the group.
        sealer: seals the checksums under the sync's key.
        chunk_bytes: the largest message.
        checksum: the checksum of a piece's bytes (an engine's ``bucket_checksum``).
        timeout: seconds any wait may take before the exchange fails, naming the peer.
    """

    def __init__(self, group: PointToPoint, plan: TransferPlan, shapes: Shapes,
                 dtypes: Mapping[str, torch.dtype], actor_ranks: int, sealer: MessageSealer,
                 chunk_bytes: int = 64 << 20, timeout: float = 300.0,
                 checksum: Callable[[torch.Tensor], int] = host_checksum) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.group = group
        self.plan = plan
        self.shapes = shapes
        self.dtypes = dtypes
        self.actor_ranks = actor_ranks
        self.sealer = sealer
        self.chunk_bytes = chunk_bytes
        self.checksum = checksum
        self._frame_bytes = len(self.sealed_checksum(0, 0, 0))
        """Bytes of a sealed checksum frame (the same for every piece)."""
        self.timeout = timedelta(seconds=timeout)
        self.seconds = timeout
        self._first_tag: list[int] = []
        self.free_tag = 0
        """The first gloo tag the plan's messages leave unused (for a carrier's own)."""
        self.use_carrier(GlooCarrier())

    def use_carrier(self, carrier: PieceCarrier) -> None:
        """Move the pieces' bytes with ``carrier`` (every process of the group alike)."""
        self.carrier = carrier
        self._first_tag = []
        tag = 0
        for transfer in self.plan.transfers:  # every process numbers the messages alike
            self._first_tag.append(tag)
            tag += carrier.messages(self, self.capacity(transfer)) + 1  # + its checksum
        self.free_tag = tag

    def piece_bytes(self, transfer: Transfer) -> int:
        """Bytes of ``transfer``'s piece as it travels."""
        return transfer.box.numel * self.dtypes[transfer.name].itemsize

    def capacity(self, transfer: Transfer) -> int:
        """The most bytes ``transfer``'s piece takes as it travels, whole or as a patch
        (:func:`piece_capacity`)."""
        return piece_capacity(self.piece_bytes(transfer))

    def frame_tag(self, index: int) -> int:
        """The gloo tag of the plan's ``index``-th piece's sealed checksum."""
        return self._first_tag[index] + self.carrier.messages(
            self, self.capacity(self.plan.transfers[index]))

    def check_length(self, index: int, transfer: Transfer, nbytes: int, patches: bool
                     ) -> None:
        """Refuse a piece announced as ``nbytes`` long where it may not be: more than its
        capacity, or, unless pieces travel as ``patches``, other than its bytes.

        Raises:
            TransferError: naming the piece and its sender.
        """
        whole = self.piece_bytes(transfer)
        if nbytes > self.capacity(transfer) or (not patches and nbytes != whole):
            raise self.corrupt(index, transfer, f"its sender announced {nbytes} bytes, where "
                               f"it takes {'at most ' if patches else ''}"
                               f"{self.capacity(transfer) if patches else whole}")

    def corrupt(self, index: int, transfer: Transfer, why: str) -> TransferError:
        """The error of the plan's ``index``-th piece arriving malformed (``why``)."""
        peer = transfer.source
        return TransferError(f"rollout rank {transfer.receiver}: the piece {transfer.box} of "
                             f"tensor {transfer.name!r} from {peer} (piece {index}) was "
                             f"refused: {why}", peer=peer, stage="receiving")

    def source_rank(self, transfer: Transfer) -> int:
        """The group rank that sends ``transfer`` (an actor rank, or a relaying worker)."""
        return transfer.sender + (self.actor_ranks if transfer.relayed else 0)

    def chunks(self, nbytes: int) -> int:
        """Messages (or writes) of at most ``chunk_bytes`` that ``nbytes`` bytes take."""
        return max(1, -(-nbytes // self.chunk_bytes))

    def agree(self, rank_in_group: int, group_size: int) -> None:
        """Check that every process of the group holds this plan (a collective: all call it).

        Raises:
            TransferError: naming the processes whose plan differs.
        """
        mine = torch.frombuffer(bytearray(bytes.fromhex(self.plan.digest)), dtype=torch.uint8)
        everyone = [torch.empty_like(mine) for _ in range(group_size)]
        self.wait(self.group.allgather([everyone], [mine]), "every process", "agreeing")
        differ = [self._name(rank) for rank, digest in enumerate(everyone)
                  if not torch.equal(digest, mine)]
        if differ:
            raise TransferError(
                f"{self._name(rank_in_group)}: the transfer plan of {', '.join(differ)} "
                "differs from this one (another membership or layout); nothing was sent",
                stage="agreeing")

    def send(self, rank: int, held: Layout, shards: Iterable[tuple[str, torch.Tensor]],
             encoder: PieceEncoder | None = None) -> int:
        """Send actor rank ``rank``'s pieces from ``shards`` (``(name, the piece of that
        tensor its layout holds)``, in stream order), as ``encoder`` makes them; returns
        the bytes sent. See :meth:`sender` for the errors."""
        sending = self.sender(rank, held, encoder)
        for name, shard in shards:
            sending.put(name, shard)
        return sending.finish()

    def sender(self, rank: int, held: Layout, encoder: PieceEncoder | None = None
               ) -> PlanSender:
        """Actor rank ``rank``'s sending, one shard at a time (:class:`PlanSender`), its
        pieces as ``encoder`` makes them (default: :class:`WholePieces`).

        Raises:
            ValueError: the plan has this rank send rows its layout does not hold (before
                anything is sent).
        """
        mine = self._by_name(self._indexed(lambda t: t.sender == rank and not t.relayed))
        for name, transfers in mine.items():
            box = held.boxes.get(name)
            for _, transfer in transfers:
                if box is None or transfer.box.intersection(box) != transfer.box:
                    raise ValueError(f"actor rank {rank}: the plan sends {transfer.box} of "
                                     f"tensor {name!r}, but its layout holds "
                                     f"{box if box is not None else 'none of it'}")
        return PlanSender(self, rank, held, mine, encoder or WholePieces())

    def receive(self, rank: int, needed: Layout, decoder: PieceDecoder | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Rollout rank ``rank``'s boxes, tensor by tensor in stream order: ``(name, the
        box of that tensor its layout needs)``, each piece checked, then placed by
        ``decoder`` (default: :class:`WholePieces`).

        Raises:
            ValueError: before anything is received, where the plan does not deliver
                exactly the boxes ``needed`` declares.
            VerificationError: a piece whose bytes differ from its sender's checksum.
            TransferError: a sender failed or a wait ran past the timeout (naming it).
        """
        mine = self._by_name(self._indexed(lambda t: t.receiver == rank))
        self._check_delivers(rank, needed, mine)
        forwards = self._forwards(rank)
        decoder = decoder or WholePieces()
        pending: list[tuple[Work, Transfer]] = []
        for name in self.shapes:
            want = needed.boxes.get(name)
            if want is None:
                continue
            out = decoder.begin(name, want.shape, self.dtypes[name])
            for index, transfer in mine.get(name, []):
                piece, checksum = self._receive_piece(index, transfer, decoder.patches)
                for relayed_index, relayed in forwards.get((name, transfer.box), []):
                    pending.extend(self._forward(relayed_index, relayed, index, piece, checksum))
                decoder.place(name, out, transfer.box.within(want), piece)
            yield name, decoder.finish(name, out)
        self.drain(pending, "relaying")

    def _forwards(self, rank: int) -> dict[tuple[str, Box], list[tuple[int, Transfer]]]:
        """The pieces rollout rank ``rank`` relays, by the name and box it receives them as.

        Raises:
            ValueError: the plan has it relay a piece it does not receive.
        """
        received = {(t.name, t.box) for t in self.plan.received_by(rank)}
        forwards: dict[tuple[str, Box], list[tuple[int, Transfer]]] = defaultdict(list)
        for index, transfer in self._indexed(lambda t: t.relayed and t.sender == rank):
            if (transfer.name, transfer.box) not in received:
                raise ValueError(f"rollout rank {rank}: the plan has it relay {transfer.box} "
                                 f"of tensor {transfer.name!r}, which it does not receive; "
                                 "nothing was received")
            forwards[(transfer.name, transfer.box)].append((index, transfer))
        return dict(forwards)

    def _forward(self, index: int, transfer: Transfer, received: int, data: torch.Tensor,
                 checksum: int) -> list[tuple[Work, Transfer]]:
        """Relay the checked piece ``data`` (the plan's ``received``-th) as its ``index``-th,
        with its checksum; returns the sends in flight."""
        tag = self.first_tag(index)
        works = self.carrier.forward_piece(self, index, transfer, received, data, tag)
        frame = torch.frombuffer(bytearray(self.sealed_checksum(index, data.numel(), checksum)),
                                 dtype=torch.uint8)
        works.append(self.post(self.group.send, frame, self.actor_ranks + transfer.receiver,
                               self.frame_tag(index), f"rollout rank {transfer.receiver}",
                               "relaying"))
        return [(work, transfer) for work in works]

    def _receive_piece(self, index: int, transfer: Transfer, patches: bool
                       ) -> tuple[torch.Tensor, int]:
        """The plan's ``index``-th piece (its bytes as they travelled: a patch, where
        ``patches``), checked, and its checksum."""
        peer = transfer.source
        received, works = self.carrier.receive_piece(self, index, transfer,
                                                     self.first_tag(index))
        frame = torch.empty(self._frame_bytes, dtype=torch.uint8)
        works.append(self.post(self.group.recv, frame, self.source_rank(transfer),
                               self.frame_tag(index), peer, "receiving"))
        for work in works:
            self.wait(work, peer, "receiving")
        where = (f"rollout rank {transfer.receiver}: the piece {transfer.box} of tensor "
                 f"{transfer.name!r} from {peer}")
        try:
            plan, piece, nbytes, checksum = _CHECKSUM.unpack(
                self.sealer.open(frame.numpy().tobytes()))
        except UnauthenticatedMessageError:
            raise VerificationError(f"{where} came with a checksum not sealed under this "
                                    "sync's key", tensors=[transfer.name], source=peer) from None
        if plan.hex() != self.plan.digest or piece != index:
            raise VerificationError(f"{where} is corrupt: its checksum is another piece's",
                                    tensors=[transfer.name], source=peer)
        self.check_length(index, transfer, nbytes, patches)
        data = self.carrier.collect(self, index, transfer, received, nbytes)
        if self.checksum(data) != checksum:
            raise VerificationError(f"{where} is corrupt: it differs from its sender's checksum",
                                    tensors=[transfer.name], source=peer)
        return data, checksum

    def _check_delivers(self, rank: int, needed: Layout,
                        mine: Mapping[str, list[tuple[int, Transfer]]]) -> None:
        for name in set(needed.boxes) | set(mine):
            want = needed.boxes.get(name)
            pieces = [transfer.box for _, transfer in mine.get(name, [])]
            inside = want is not None and all(
                box.intersection(want) == box for box in pieces)
            if not inside or sum(box.numel for box in pieces) != (want.numel if want else 0):
                raise ValueError(
                    f"rollout rank {rank}: the plan delivers {[str(box) for box in pieces]} "
                    f"of tensor {name!r}, but its layout needs "
                    f"{want if want is not None else 'none of it'}; nothing was received")

    def _indexed(self, keep: Callable[[Transfer], bool]) -> list[tuple[int, Transfer]]:
        return [(index, transfer) for index, transfer in enumerate(self.plan.transfers)
                if keep(transfer)]

    @staticmethod
    def _by_name(items: list[tuple[int, Transfer]]) -> dict[str, list[tuple[int, Transfer]]]:
        grouped: dict[str, list[tuple[int, Transfer]]] = defaultdict(list)
        for index, transfer in items:
            grouped[transfer.name].append((index, transfer))
        return dict(grouped)

    def sealed_checksum(self, index: int, nbytes: int, checksum: int) -> bytes:
        """The frame announcing the plan's ``index``-th piece's length, ``nbytes``, and
        ``checksum``."""
        return self.sealer.seal(_CHECKSUM.pack(bytes.fromhex(self.plan.digest), index,
                                               nbytes, checksum))

    def first_tag(self, index: int) -> int:
        """The tag of the first message of the plan's ``index``-th transfer."""
        return self._first_tag[index]

    def post(self, operation: Callable[[list[torch.Tensor], int, int], Work],
             tensor: torch.Tensor, rank: int, tag: int, peer: str, stage: str) -> Work:
        """Post ``operation`` (the group's ``send`` or ``recv``) of ``tensor`` with group
        rank ``rank``, naming ``peer`` where the group refuses (its connection died)."""
        try:
            return operation([tensor], rank, tag)
        except RuntimeError as exc:
            raise TransferError(f"{stage} failed with {peer}: {exc}", peer=peer,
                                stage=stage) from None

    def drain(self, pending: list[tuple[Work, Transfer]], stage: str) -> None:
        """Wait for ``pending`` sends (then empties it), naming a receiver that failed."""
        for work, transfer in pending:
            self.wait(work, f"rollout rank {transfer.receiver}", stage)
        pending.clear()

    def wait(self, work: Work, peer: str, stage: str) -> None:
        """Wait for ``work`` up to the timeout, naming ``peer`` where it fails."""
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise TransferError(f"{stage} failed with {peer}: {exc}", peer=peer,
                                stage=stage) from None

    def _name(self, group_rank: int) -> str:
        if group_rank < self.actor_ranks:
            return f"actor rank {group_rank}"
        return f"rollout rank {group_rank - self.actor_ranks}"



class PlanSender:
    """One actor rank's sends of one sync: :meth:`put` each shard in stream order, then
    :meth:`finish`. Made by :meth:`PlanExchange.sender`."""

    def __init__(self, exchange: PlanExchange, rank: int, held: Layout,
                 mine: Mapping[str, list[tuple[int, Transfer]]],
                 encoder: PieceEncoder) -> None:
        self.exchange = exchange
        self.encoder = encoder
        self.rank = rank
        self.held = held
        self.mine = mine
        self.remaining = [name for name in exchange.shapes if name in held.boxes]
        self.pending: list[tuple[Work, Transfer]] = []
        self.in_flight = 0
        self.sent = 0
        self.messages = 0
        """Data messages (chunks) posted."""

    def put(self, name: str, shard: torch.Tensor) -> None:
        """Send the pieces of ``shard`` (this rank's box of tensor ``name``).

        Raises:
            ValueError: a shard out of order or not of its layout's shape and dtype.
            TransferError: a receiver failed or a send ran past the timeout (naming it).
        """
        exchange, rank = self.exchange, self.rank
        if not self.remaining or name != self.remaining[0]:
            raise ValueError(f"actor rank {rank}: its weights yielded tensor {name!r} where its "
                             f"layout expects {self.remaining[0] if self.remaining else 'none'}")
        self.remaining.pop(0)
        box = self.held.boxes[name]
        if tuple(shard.shape) != box.shape or shard.dtype != exchange.dtypes[name]:
            raise ValueError(f"actor rank {rank}: tensor {name!r} is {list(shard.shape)} "
                             f"{shard.dtype}; its layout holds {box} of {exchange.dtypes[name]}")
        mine = self.mine.get(name, [])
        datas = self.encoder.pieces(name, shard, [t.box.within(box) for _, t in mine])
        for (index, transfer), data in zip(mine, datas, strict=True):
            receiver = f"rollout rank {transfer.receiver}"
            works = exchange.carrier.send_piece(exchange, index, transfer, data,
                                                exchange.first_tag(index))
            self.pending.extend((work, transfer) for work in works)
            self.messages += exchange.chunks(data.numel())
            frame = exchange.sealed_checksum(index, data.numel(), exchange.checksum(data))
            checksum = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
            self.pending.append((exchange.post(
                exchange.group.send, checksum, exchange.actor_ranks + transfer.receiver,
                exchange.frame_tag(index), receiver, "sending"), transfer))
            self.in_flight += data.numel()
            self.sent += data.numel()
        if self.in_flight >= _IN_FLIGHT_BYTES:
            exchange.drain(self.pending, "sending")
            self.in_flight = 0

    def finish(self) -> int:
        """Wait for every send; returns the bytes sent.

        Raises:
            ValueError: the weights ended before a tensor this rank's layout holds.
            TransferError: a receiver failed or a send ran past the timeout (naming it).
        """
        if self.remaining:
            raise ValueError(f"actor rank {self.rank}: its weights ended before tensor "
                             f"{self.remaining[0]!r}, which its layout holds")
        self.exchange.drain(self.pending, "sending")
        return self.sent
