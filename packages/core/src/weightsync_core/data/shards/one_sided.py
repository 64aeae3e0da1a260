"""A plan's pieces written one-sidedly: every actor rank writes its pieces straight into
the registered landing buffers of the rollout workers that need them (NIXL, Mooncake, ...:
any :class:`~weightsync_core.net.transport.PeerTransport`), many senders at once; a worker
that relays writes the pieces it forwards straight from its own landing buffer into the
next worker's; each piece's sealed checksum follows on the exchange's gloo group once its
bytes have landed, and the worker checks a copy of them out of its registered memory."""

from __future__ import annotations

import contextlib
import struct
from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import Any

import msgspec
import torch
from torch.distributed.distributed_c10d import Work

from weightsync_core.api.errors import (
    MalformedMessageError,
    TransferError,
    UnauthenticatedMessageError,
)
from weightsync_core.data.devices import allocate_bucket
from weightsync_core.data.shards.exchange import PlanExchange
from weightsync_core.data.shards.transfers import Transfer
from weightsync_core.net.transport import PeerTransport, RemoteBuffer
from weightsync_core.net.wire import MessageCodec

__all__ = ["KnownReceivers", "Landing", "OneSidedCarrier", "RegisteredBuffer"]

_LENGTH = struct.Struct("<Q")
_LARGEST_LANDING_FRAME = 1 << 20  # transport metadata is a few KiB at most


class Landing(msgspec.Struct, frozen=True):
    """A rollout worker's landing buffer as its senders reach it."""

    peer: Any
    """The worker's transport metadata."""
    buffer: RemoteBuffer


_CODEC: MessageCodec[Landing] = MessageCodec(Landing)


class RegisteredBuffer:
    """One registered ``uint8`` buffer an engine keeps between syncs: replaced (and
    registered anew) only when a sync needs more bytes, so that a sync like the last one
    registers nothing and its peers' view of it stays valid.

    Args:
        transport: the transport it is registered with (called when first needed).
        device: where it is allocated.
    """

    def __init__(self, transport: Callable[[], PeerTransport], device: torch.device) -> None:
        self._transport = transport
        self.device = device
        self.tensor: torch.Tensor | None = None
        self.remote: RemoteBuffer | None = None

    def at_least(self, nbytes: int) -> tuple[torch.Tensor, RemoteBuffer]:
        """The buffer, at least ``nbytes`` (>= 1) long, and how peers address it."""
        if self.tensor is None or self.remote is None or self.tensor.numel() < nbytes:
            self.release()
            tensor = allocate_bucket(max(nbytes, 1), self.device)
            self.remote = self._transport().register(tensor)
            self.tensor = tensor
        return self.tensor, self.remote

    def scrub(self) -> None:
        """Zero it: no weights stay in memory peers can reach between syncs."""
        if self.tensor is not None:
            self.tensor.zero_()

    def release(self) -> None:
        """Deregister and free it (idempotent)."""
        tensor, self.tensor, self.remote = self.tensor, None, None
        if tensor is not None:
            with contextlib.suppress(Exception):
                self._transport().deregister(tensor)


class KnownReceivers:
    """A sender's connections to rollout workers, kept between syncs: a worker that hands
    out the same landing is not connected again; one whose transport metadata changed (it
    registered a larger buffer, or another process holds its rank now) is disconnected and
    connected afresh, so no stale view of its memory remains."""

    def __init__(self, transport: Callable[[], PeerTransport]) -> None:
        self._transport = transport
        self._known: dict[int, tuple[Any, Hashable]] = {}

    def connect(self, rank: int, landing: Landing) -> Hashable:
        """The handle of rollout rank ``rank``'s transport, as its ``landing`` says."""
        known = self._known.get(rank)
        if known is not None and known[0] == landing.peer:
            return known[1]
        if known is not None:
            self._forget(rank)
        handle = self._transport().connect(landing.peer)
        self._known[rank] = (landing.peer, handle)
        return handle

    def forget_all(self) -> None:
        """Disconnect every worker (after a failed sync)."""
        for rank in list(self._known):
            self._forget(rank)

    def _forget(self, rank: int) -> None:
        _, handle = self._known.pop(rank)
        if all(other != handle for _, other in self._known.values()):
            with contextlib.suppress(Exception):
                self._transport().disconnect(handle)


class OneSidedCarrier:
    """Pieces written through ``transport`` (a :class:`~weightsync_core.data.shards.PieceCarrier`).

    Build it with :meth:`connect` (a collective of the exchange's group); :meth:`close` it
    at the end of the sync, which deregisters its buffers.
    """

    def __init__(self, exchange: PlanExchange, transport: PeerTransport) -> None:
        self.transport = transport
        self.offsets = _landing_offsets(exchange)
        """Each piece's offset in its receiver's landing buffer (by plan index)."""
        self.landing: torch.Tensor | None = None
        self.staging: torch.Tensor | None = None
        self.receivers: dict[int, tuple[Hashable, RemoteBuffer]] = {}
        """Rollout rank -> its transport peer and landing buffer (on a sender)."""

    @classmethod
    def connect(cls, exchange: PlanExchange, transport: PeerTransport, group_rank: int,
                buffer: RegisteredBuffer, receivers: KnownReceivers) -> OneSidedCarrier:
        """Make this process's registered ``buffer`` large enough (a worker's landing
        buffer for the pieces it receives; a sender's staging buffer of one chunk) and hand
        every sender the landing buffers it writes into: each worker sends its
        :class:`Landing`, sealed, to each of its senders (actor ranks, and the workers that
        relay to it) over the group, which connect to it through ``receivers`` (a
        collective: every process of the group calls it).

        Raises:
            TransferError: a peer failed, or sent a landing not sealed under this sync's key
                (naming it).
        """
        carrier = cls(exchange, transport)
        exchange.use_carrier(carrier)
        if group_rank < exchange.actor_ranks:
            carrier._take_landings(exchange, group_rank, buffer, receivers)
            return carrier
        rank = group_rank - exchange.actor_ranks
        handing_out = carrier._hand_out_landing(exchange, rank, buffer)
        # the workers this one relays to may relay to it too: its sends are posted first
        carrier._take_landings_of(exchange, exchange.plan.sent_by(rank, relayed=True),
                                  receivers)
        for work, peer in handing_out:
            exchange.wait(work, peer, "connecting")
        return carrier

    # -- PieceCarrier ----------------------------------------------------------------------
    def messages(self, exchange: PlanExchange, nbytes: int) -> int:
        """No gloo message: the bytes are written."""
        return 0

    def send_piece(self, exchange: PlanExchange, index: int, transfer: Transfer,
                   data: torch.Tensor, tag: int) -> list[Work]:
        """Write ``data`` into the receiver's landing buffer, a staging buffer at a time;
        returns once it has landed."""
        staging = self._require(self.staging)
        self._write(exchange, transfer, data, index, staging.numel(), staging)
        return []

    def _write(self, exchange: PlanExchange, transfer: Transfer, data: torch.Tensor,
               index: int, step: int, staging: torch.Tensor | None = None) -> None:
        """Write ``data`` (registered, or copied through ``staging`` a ``step`` at a time)
        at the plan's ``index``-th piece's place in its receiver's landing buffer."""
        peer, landing = self.receivers[transfer.receiver]
        offset = self.offsets[index]
        for start in range(0, data.numel(), step):
            local = data[start:start + step]
            if staging is not None:
                local = staging[:local.numel()].copy_(local)
            try:
                self.transport.write(peer, local, landing.at(offset + start, local.numel()),
                                     exchange.seconds)
            except Exception as exc:
                who = f"rollout rank {transfer.receiver}"
                stage = "relaying" if transfer.relayed else "sending"
                raise TransferError(f"{stage} failed with {who}: {type(exc).__name__}: {exc}",
                                    code=getattr(exc, "code", None), peer=who,
                                    stage=stage) from None

    def receive_piece(self, exchange: PlanExchange, index: int, transfer: Transfer,
                      tag: int) -> tuple[torch.Tensor | None, list[Work]]:
        """Nothing to post: the sender writes (:meth:`collect` finds the bytes)."""
        return None, []

    def forward_piece(self, exchange: PlanExchange, index: int, transfer: Transfer,
                      received: int, data: torch.Tensor, tag: int) -> list[Work]:
        """Write the ``received``-th piece from this worker's landing buffer (registered)
        into the next worker's; returns once it has landed. Its checksum, sent after, is
        that of the checked copy ``data``: bytes changed in the landing since then fail
        at the next worker."""
        landing = self._require(self.landing)
        start = self.offsets[received]
        self._write(exchange, transfer, landing[start:start + data.numel()], index,
                    exchange.chunk_bytes)
        return []

    def collect(self, exchange: PlanExchange, index: int, transfer: Transfer,
                received: torch.Tensor | None, nbytes: int) -> torch.Tensor:
        """A copy of the piece's ``nbytes`` out of the landing buffer (then it is
        checked)."""
        landing = self._require(self.landing)
        offset = self.offsets[index]
        return landing[offset:offset + nbytes].clone()

    # -- set-up ----------------------------------------------------------------------------
    def _hand_out_landing(self, exchange: PlanExchange, rank: int,
                          buffer: RegisteredBuffer) -> list[tuple[Work, str]]:
        """Post the sends of rollout rank ``rank``'s landing to its senders; returns them."""
        mine = exchange.plan.received_by(rank)
        self.landing, remote = buffer.at_least(
            sum(exchange.capacity(transfer) for transfer in mine))
        frame = exchange.sealer.seal(_CODEC.encode(Landing(self.transport.metadata(), remote)))
        body = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        length = torch.frombuffer(bytearray(_LENGTH.pack(len(frame))), dtype=torch.uint8)
        works = []
        senders = {exchange.source_rank(transfer): transfer.source for transfer in mine}
        for sender, peer in sorted(senders.items()):
            works.append((exchange.post(exchange.group.send, length, sender,
                                        exchange.free_tag, peer, "connecting"), peer))
            works.append((exchange.post(exchange.group.send, body, sender,
                                        exchange.free_tag + 1, peer, "connecting"), peer))
        return works

    def _take_landings(self, exchange: PlanExchange, rank: int, buffer: RegisteredBuffer,
                       receivers: KnownReceivers) -> None:
        mine = exchange.plan.sent_by(rank)
        if not mine:
            return
        largest = max(exchange.capacity(transfer) for transfer in mine)
        self.staging, _ = buffer.at_least(min(largest, exchange.chunk_bytes))
        self._take_landings_of(exchange, mine, receivers)

    def _take_landings_of(self, exchange: PlanExchange, transfers: list[Transfer],
                          receivers: KnownReceivers) -> None:
        """Receive the landing of every worker ``transfers`` go to and connect to it."""
        for receiver in sorted({transfer.receiver for transfer in transfers}):
            landing = _receive_landing(exchange, receiver)
            self.receivers[receiver] = (receivers.connect(receiver, landing), landing.buffer)

    @staticmethod
    def _require(buffer: torch.Tensor | None) -> torch.Tensor:
        if buffer is None:
            raise TransferError("the one-sided carrier is closed (did its sync end?)",
                                stage="sending")
        return buffer


def _landing_offsets(exchange: PlanExchange) -> list[int]:
    """Each piece's offset in its receiver's landing buffer: the places of the pieces a
    worker receives lie back to back, in plan order, each as large as the piece may be
    (:meth:`PlanExchange.capacity`: a patch of it takes a little more)."""
    filled: dict[int, int] = defaultdict(int)
    offsets = []
    for transfer in exchange.plan.transfers:
        offsets.append(filled[transfer.receiver])
        filled[transfer.receiver] += exchange.capacity(transfer)
    return offsets


def _receive_landing(exchange: PlanExchange, receiver: int) -> Landing:
    """Rollout rank ``receiver``'s landing, sealed, over the exchange's group."""
    group_rank = exchange.actor_ranks + receiver
    peer = f"rollout rank {receiver}"
    length = torch.empty(_LENGTH.size, dtype=torch.uint8)
    exchange.wait(exchange.post(exchange.group.recv, length, group_rank, exchange.free_tag,
                                peer, "connecting"), peer, "connecting")
    (nbytes,) = _LENGTH.unpack(length.numpy().tobytes())
    if not 0 < nbytes <= _LARGEST_LANDING_FRAME:
        raise TransferError(f"connecting failed with {peer}: it announced a "
                            f"{nbytes}-byte landing", peer=peer, stage="connecting")
    body = torch.empty(nbytes, dtype=torch.uint8)
    exchange.wait(exchange.post(exchange.group.recv, body, group_rank,
                                exchange.free_tag + 1, peer, "connecting"),
                  peer, "connecting")
    try:
        return _CODEC.decode(exchange.sealer.open(body.numpy().tobytes()))
    except (UnauthenticatedMessageError, MalformedMessageError) as exc:
        raise TransferError(f"connecting failed with {peer}: its landing was refused "
                            f"({exc})", peer=peer, stage="connecting") from None
