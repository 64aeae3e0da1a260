"""A side channel for small control messages between engine processes, over ZeroMQ.

Transports that move bucket bytes one-sidedly (NIXL, Mooncake) still need to say "bucket
``k`` is in slot ``s``" and "slot ``s`` is free again". Each process binds one PULL socket
(its inbox) on its configured host only, and keeps a PUSH socket per peer it writes to.
Waiting on the inbox blocks in ZeroMQ's poller: no core spins while a process waits.

Anyone who can reach the inbox port can send to it, so nothing received is trusted: every
frame must carry the sync's HMAC tag (:class:`~weightsync_core.wire.MessageSealer`) and
decode into the engine's fixed schema (:class:`~weightsync_core.wire.MessageCodec`). Frames
that fail either check are dropped, counted in :attr:`ControlChannel.rejected` and logged;
they never reach the engine. Late messages of the last few syncs (a credit that arrives
after its sync ended) are dropped quietly and counted in :attr:`ControlChannel.stale`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from weightsync_core.errors import MalformedMessageError, UnauthenticatedMessageError
from weightsync_core.process_group import check_bind_host, default_host
from weightsync_core.transport import PeerTransport
from weightsync_core.wire import MessageCodec, MessageSealer

__all__ = ["ControlChannel", "PeerEndpoints", "zmq_endpoint"]

logger = logging.getLogger(__name__)

M = TypeVar("M")
T = TypeVar("T", bound=PeerTransport)

MAX_MESSAGE_BYTES = 64 << 20
"""Larger frames are refused by ZeroMQ before they are buffered (a share manifest of a
model with 100k tensors is a few MiB)."""


def zmq_endpoint(host: str, port: int | None = None) -> str:
    """``tcp://host:port`` (IPv6 hosts bracketed); no port gives the bind prefix."""
    address = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{address}" if port is None else f"tcp://{address}:{port}"


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
        self.rejected = 0
        """Frames dropped because they were unauthenticated or malformed."""
        self.stale = 0
        """Frames of earlier syncs, dropped quietly."""
        self._context = zmq.asyncio.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.port = self._inbox.bind_to_random_port(zmq_endpoint(host))
        self.endpoint = zmq_endpoint(host, self.port)
        self._outboxes: dict[str, zmq.asyncio.Socket] = {}

    def use_key(self, key: bytes) -> None:
        """Seal and accept messages under ``key`` (this sync's session key) from now on."""
        if self._sealer is not None:
            self._retired.append(self._sealer.key_id)
        self._sealer = MessageSealer(key)

    def _require_sealer(self) -> MessageSealer:
        if self._sealer is None:
            raise RuntimeError("the control channel has no session key yet (use_key first)")
        return self._sealer

    async def send(self, endpoint: str, message: M, timeout: float) -> None:
        """Queue ``message`` for the peer at ``endpoint``; raises :class:`TimeoutError` if
        the peer cannot take it within ``timeout`` seconds (it is gone or not listening)."""
        frame = self._require_sealer().seal(self._codec.encode(message))
        socket = self._outboxes.get(endpoint)
        if socket is None:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not there
            socket.connect(endpoint)
            self._outboxes[endpoint] = socket
        await asyncio.wait_for(socket.send(frame, copy=False), timeout)

    async def receive(self, timeout: float | None = None) -> M:
        """The next authentic, well-formed message in the inbox (others are dropped);
        :class:`TimeoutError` after ``timeout`` seconds (``None``: wait until cancelled)."""
        return await asyncio.wait_for(self._next_valid(), timeout)

    async def _next_valid(self) -> M:
        while True:
            frame = await self._inbox.recv(copy=True)
            try:
                return self._codec.decode(self._require_sealer().open(frame))
            except (UnauthenticatedMessageError, MalformedMessageError, RuntimeError) as exc:
                if MessageSealer.key_id_of(frame) in self._retired:
                    self.stale += 1  # sealed under an earlier sync's key: a late message
                    continue
                self.rejected += 1
                if _worth_logging(self.rejected):
                    logger.warning(
                        "control channel %s dropped a message (%d dropped so far): %s",
                        self.endpoint, self.rejected, exc,
                    )

    def keep_only(self, endpoints: set[str]) -> None:
        """Close the outgoing sockets to peers not in ``endpoints`` (they left the ring)."""
        for endpoint in [e for e in self._outboxes if e not in endpoints]:
            self._outboxes.pop(endpoint).close(linger=0)

    def close(self) -> None:
        """Close every socket and the context (idempotent)."""
        self.keep_only(set())
        self._inbox.close(linger=0)
        self._context.term()


def _worth_logging(count: int) -> bool:
    """Log the 1st, 10th, 100th, ... dropped message: visible, but no log flood."""
    while count % 10 == 0:
        count //= 10
    return count == 1


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
