"""A side channel for small control messages between engine processes, over ZeroMQ.

Transports that move bucket bytes one-sidedly (NIXL, Mooncake) still need to say "bucket
``k`` is in slot ``s``" and "slot ``s`` is free again". Each process binds one PULL socket
(its inbox) on its configured host only, and keeps a PUSH socket per peer it writes to.
Waiting on the inbox blocks in ZeroMQ's poller: no core spins while a process waits.

Anyone who can reach the inbox port can send to it, so nothing received is trusted:

- **Bounded before it is authenticated.** ZeroMQ refuses a frame over
  :data:`MAX_FRAME_BYTES` before buffering it (it drops the connection), queues at most
  :data:`INBOX_QUEUE_FRAMES` frames per connection, and drops a connection that has not
  finished ZeroMQ's handshake within :data:`HANDSHAKE_SECONDS`. A message larger than one
  frame travels as several sealed fragments, reassembled only after each is authenticated.
- **Authenticated before it is decoded.** Every frame carries the sync's HMAC tag
  (:class:`~weightsync_core.net.wire.MessageSealer`) over an envelope that names its sender, its
  recipient and its place in the sequence of frames that sender sent that recipient under
  this key. Frames that fail the tag, name another recipient, or come out of sequence (a
  replay of a captured frame, a duplicate) are dropped and counted
  (:attr:`ControlChannel.rejected`, :attr:`ControlChannel.replayed`); they never reach the
  engine. Messages decode only into the engine's fixed schema
  (:class:`~weightsync_core.net.wire.MessageCodec`).
- Late frames of the last few syncs (a credit that arrives after its sync ended) are
  dropped quietly and counted in :attr:`ControlChannel.stale`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from weightsync_core.api.errors import MalformedMessageError, UnauthenticatedMessageError
from weightsync_core.api.hosts import check_bind_host, default_host
from weightsync_core.net.transport import PeerTransport
from weightsync_core.net.wire import MessageCodec, MessageSealer, worth_logging

__all__ = [
    "HANDSHAKE_SECONDS",
    "INBOX_QUEUE_FRAMES",
    "MAX_FRAME_BYTES",
    "MAX_MESSAGE_BYTES",
    "ControlChannel",
    "PeerEndpoints",
    "zmq_endpoint",
]

logger = logging.getLogger(__name__)

M = TypeVar("M")
T = TypeVar("T", bound=PeerTransport)

FRAGMENT_BYTES = 256 << 10
"""Payload of one frame: a larger message (a kimi share manifest of a big model) is sent as
several fragments. Most control messages (credits, bucket announcements) fit one."""
MAX_FRAME_BYTES = FRAGMENT_BYTES + (4 << 10)
"""The largest frame an inbox accepts: a fragment plus its sealed envelope (the endpoints
it names are at most a few dozen bytes). ZeroMQ drops a peer that sends a larger one before
buffering it."""
INBOX_QUEUE_FRAMES = 8
"""Frames ZeroMQ queues per connection before it stops reading that connection."""
HANDSHAKE_SECONDS = 2.0
"""A connection must finish ZeroMQ's handshake within this time, or it is dropped."""
MAX_MESSAGE_BYTES = 1 << 30
"""The largest message a member may send (in fragments): far above any control message."""


class _Envelope(msgspec.Struct, array_like=True, frozen=True):
    """What a frame seals: who sent it to whom, its place in that sender's sequence, and a
    fragment of one encoded message (``last``: the message's final fragment)."""

    sender: str
    recipient: str
    seq: int
    last: bool
    fragment: bytes


_ENVELOPES = MessageCodec(_Envelope)


def zmq_endpoint(host: str, port: int | None = None) -> str:
    """``tcp://host:port`` (IPv6 hosts bracketed); no port gives the bind prefix."""
    address = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{address}" if port is None else f"tcp://{address}:{port}"


class _Outbox:
    """The PUSH socket to one peer."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str) -> None:
        self.socket = context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not there
        self.socket.connect(endpoint)
        self.lock = asyncio.Lock()
        """Held while a message's frames are numbered and queued, so that messages sent
        concurrently to one peer never interleave or overtake each other."""


class _Inflow:
    """What one authenticated sender has sent this inbox under the current key."""

    def __init__(self) -> None:
        self.next_seq = 0
        self.fragments: list[bytes] = []
        self.nbytes = 0


class ControlChannel(Generic[M]):
    """This process's inbox plus outgoing sockets to peers.

    Args:
        host: address to bind the inbox to (and that peers connect to); never a wildcard.
        schema: the ``msgspec`` type of every message (a union of tagged structs).
    """

    def __init__(self, host: str, schema: Any) -> None:
        check_bind_host(host)
        self._codec: MessageCodec[M] = MessageCodec(schema)
        self._sealer: MessageSealer | None = None
        self._retired: deque[bytes] = deque(maxlen=8)
        self._inflows: dict[str, _Inflow] = {}
        self._sent: dict[str, int] = {}
        """Frames sent to each peer under the current key (the next one's number)."""
        self.rejected = 0
        """Frames dropped because they were unauthenticated, malformed or addressed to
        another process."""
        self.replayed = 0
        """Authentic frames dropped because they came out of sequence (replays,
        duplicates)."""
        self.stale = 0
        """Frames of earlier syncs, dropped quietly."""
        self._context = zmq.asyncio.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._inbox.setsockopt(zmq.RCVHWM, INBOX_QUEUE_FRAMES)
        self._inbox.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_SECONDS * 1000))
        self.port = self._inbox.bind_to_random_port(zmq_endpoint(host))
        self.endpoint = zmq_endpoint(host, self.port)
        self._outboxes: dict[str, _Outbox] = {}

    def use_key(self, key: bytes) -> None:
        """Seal and accept messages under ``key`` (this sync's session key) from now on;
        every sequence starts again."""
        if self._sealer is not None:
            self._retired.append(self._sealer.key_id)
        self._sealer = MessageSealer(key)
        self._inflows.clear()
        self._sent.clear()

    def _require_sealer(self) -> MessageSealer:
        if self._sealer is None:
            raise RuntimeError("the control channel has no session key yet (use_key first)")
        return self._sealer

    async def send(self, endpoint: str, message: M, timeout: float) -> None:
        """Queue ``message`` for the peer at ``endpoint``; raises :class:`TimeoutError` if
        the peer cannot take it within ``timeout`` seconds (it is gone or not listening)."""
        sealer = self._require_sealer()
        body = self._codec.encode(message)
        if len(body) > MAX_MESSAGE_BYTES:
            raise ValueError(f"a {len(body)}-byte control message is over the "
                             f"{MAX_MESSAGE_BYTES}-byte limit")
        outbox = self._outboxes.get(endpoint)
        if outbox is None:
            outbox = self._outboxes[endpoint] = _Outbox(self._context, endpoint)
        pieces = [body[start:start + FRAGMENT_BYTES]
                  for start in range(0, len(body), FRAGMENT_BYTES)] or [b""]

        async def queue_all() -> None:
            async with outbox.lock:
                for index, piece in enumerate(pieces):
                    seq = self._sent.get(endpoint, 0)
                    self._sent[endpoint] = seq + 1
                    envelope = _Envelope(self.endpoint, endpoint, seq,
                                         index == len(pieces) - 1, piece)
                    await outbox.socket.send(sealer.seal(_ENVELOPES.encode(envelope)),
                                             copy=False)

        await asyncio.wait_for(queue_all(), timeout)

    async def receive(self, timeout: float | None = None) -> M:
        """The next authentic, well-formed message in the inbox (others are dropped);
        :class:`TimeoutError` after ``timeout`` seconds (``None``: wait until cancelled)."""
        return await asyncio.wait_for(self._next_valid(), timeout)

    async def _next_valid(self) -> M:
        while True:
            frame = await self._inbox.recv(copy=True)
            try:
                body = self._take(frame)
                if body is not None:
                    return self._codec.decode(body)
            except (UnauthenticatedMessageError, MalformedMessageError, RuntimeError) as exc:
                if MessageSealer.key_id_of(frame) in self._retired:
                    self.stale += 1  # sealed under an earlier sync's key: a late message
                else:
                    self._drop(exc)
            # A frame already queued completes the receive at once, without yielding: under
            # a flood of junk this loop would never let the event loop run anything else.
            await asyncio.sleep(0)

    def _take(self, frame: bytes) -> bytes | None:
        """Authenticate ``frame`` and add it to its sender's message; returns the message's
        body once its last fragment is in, else ``None`` (a fragment, or a frame dropped as
        out of sequence)."""
        envelope = _ENVELOPES.decode(self._require_sealer().open(frame))
        if envelope.recipient != self.endpoint:
            raise UnauthenticatedMessageError(
                f"a frame for {envelope.recipient} (a replay from another process's traffic)"
            )
        inflow = self._inflows.setdefault(envelope.sender, _Inflow())
        if envelope.seq != inflow.next_seq:
            self.replayed += 1
            if worth_logging(self.replayed):
                logger.warning(
                    "control channel %s dropped frame %d from %s, expecting frame %d: a "
                    "replay or duplicate (%d dropped so far)", self.endpoint, envelope.seq,
                    envelope.sender, inflow.next_seq, self.replayed,
                )
            return None
        inflow.next_seq += 1
        inflow.nbytes += len(envelope.fragment)
        if inflow.nbytes > MAX_MESSAGE_BYTES:
            inflow.fragments, inflow.nbytes = [], 0
            raise MalformedMessageError(f"{envelope.sender} sent a message over "
                                        f"{MAX_MESSAGE_BYTES} bytes")
        inflow.fragments.append(envelope.fragment)
        if not envelope.last:
            return None
        body = b"".join(inflow.fragments)
        inflow.fragments, inflow.nbytes = [], 0
        return body

    def _drop(self, exc: Exception) -> None:
        self.rejected += 1
        if worth_logging(self.rejected):
            logger.warning(
                "control channel %s dropped a message (%d dropped so far): %s",
                self.endpoint, self.rejected, exc,
            )

    def keep_only(self, endpoints: set[str]) -> None:
        """Close the outgoing sockets to peers not in ``endpoints`` (they left the ring)."""
        for endpoint in [e for e in self._outboxes if e not in endpoints]:
            self._outboxes.pop(endpoint).socket.close(linger=0)

    def close(self) -> None:
        """Close every socket and the context (idempotent)."""
        self.keep_only(set())
        self._inbox.close(linger=0)
        self._context.term()


class PeerEndpoints(Generic[T, M]):
    """One process's control channel and transport endpoint, each created on first use and
    kept across syncs (peer-to-peer engines hold one).

    Generic in the transport ``T`` (what ``create_transport`` returns) and the message type
    ``M`` of the channel (not inferred from ``schema``: annotate the attribute holding it).

    Args:
        host: address of this process (``None``: :func:`default_host` at first use).
        create_transport: builds the transport endpoint.
        schema: the control channel's message type.
    """

    def __init__(self, host: str | None, create_transport: Callable[[], T], schema: Any) -> None:
        self._host = host
        self._create_transport = create_transport
        self._schema = schema
        self._channel: ControlChannel[M] | None = None
        self._transport: T | None = None

    @property
    def channel(self) -> ControlChannel[M]:
        """The control channel (bound on first use)."""
        if self._channel is None:
            self._channel = ControlChannel(self._host or default_host(), self._schema)
        return self._channel

    @property
    def transport(self) -> T:
        """The transport endpoint (created on first use)."""
        if self._transport is None:
            self._transport = self._create_transport()
        return self._transport

    @property
    def has_transport(self) -> bool:
        """Whether the transport was created."""
        return self._transport is not None

    def close_outboxes(self) -> None:
        """Close the sockets to every peer (a no-op before the channel exists)."""
        if self._channel is not None:
            self._channel.keep_only(set())

    def close(self) -> None:
        """Release both (they are created again if used again)."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
