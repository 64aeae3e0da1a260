"""A side channel for small control messages between engine processes, over ZeroMQ.

Transports that move bucket bytes one-sidedly (NIXL, Mooncake) still need to say "bucket
``k`` is in slot ``s``" and "slot ``s`` is free again". Each process binds one PULL socket
(its inbox) and keeps a PUSH socket per peer it writes to. Waiting on the inbox blocks in
ZeroMQ's poller: no core spins while a process waits for its upstream.

Messages are pickled dicts, so the channel trusts whoever can reach the inbox port (the same
trust model as ``torch.distributed`` object collectives); bind to a cluster-internal address.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from weightsync_core.errors import WeightSyncError
from weightsync_core.process_group import default_host
from weightsync_core.transport import PeerTransport

__all__ = ["ControlChannel", "PeerEndpoints", "zmq_endpoint"]


def zmq_endpoint(host: str, port: int | None = None) -> str:
    """``tcp://host:port`` (IPv6 hosts bracketed); no port gives the bind prefix."""
    address = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{address}" if port is None else f"tcp://{address}:{port}"


class ControlChannel:
    """This process's inbox plus outgoing sockets to peers.

    Args:
        host: address to bind the inbox to (and that peers connect to).
    """

    def __init__(self, host: str) -> None:
        self._context = zmq.asyncio.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self.port = self._inbox.bind_to_random_port(zmq_endpoint(host))
        self.endpoint = zmq_endpoint(host, self.port)
        self._outboxes: dict[str, zmq.asyncio.Socket] = {}

    async def send(self, endpoint: str, message: dict[str, Any], timeout: float) -> None:
        """Queue ``message`` for the peer at ``endpoint``; raises :class:`TimeoutError` if
        the peer cannot take it within ``timeout`` seconds (it is gone or not listening)."""
        socket = self._outboxes.get(endpoint)
        if socket is None:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not there
            socket.connect(endpoint)
            self._outboxes[endpoint] = socket
        await asyncio.wait_for(socket.send_pyobj(message), timeout)

    async def receive(self, timeout: float | None = None) -> dict[str, Any]:
        """The next message in the inbox; :class:`TimeoutError` after ``timeout`` seconds
        (``None``: wait until cancelled)."""
        message = await asyncio.wait_for(self._inbox.recv_pyobj(), timeout)
        if not isinstance(message, dict):
            raise WeightSyncError(f"control channel received a {type(message).__name__}, "
                                  "not a message dict; is another program using this port?")
        return message

    def keep_only(self, endpoints: set[str]) -> None:
        """Close the outgoing sockets to peers not in ``endpoints`` (they left the ring)."""
        for endpoint in [e for e in self._outboxes if e not in endpoints]:
            self._outboxes.pop(endpoint).close(linger=0)

    def close(self) -> None:
        """Close every socket and the context (idempotent)."""
        self.keep_only(set())
        self._inbox.close(linger=0)
        self._context.term()


class PeerEndpoints:
    """One process's control channel and transport endpoint, each created on first use and
    kept across syncs (peer-to-peer engines hold one).

    Args:
        host: address of this process (``None``: :func:`default_host` at first use).
        create_transport: builds the transport endpoint.
    """

    def __init__(self, host: str | None, create_transport: Callable[[], PeerTransport]) -> None:
        self._host = host
        self._create_transport = create_transport
        self._channel: ControlChannel | None = None
        self._transport: PeerTransport | None = None

    @property
    def channel(self) -> ControlChannel:
        """The control channel (bound on first use)."""
        if self._channel is None:
            self._channel = ControlChannel(self._host or default_host())
        return self._channel

    @property
    def transport(self) -> PeerTransport:
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
