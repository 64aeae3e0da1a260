"""``--measure``: probe a link's bandwidth and latency between two Ray actors over TCP.

The receiver listens on its own node's address only and serves one connection that opens
with a random 32-byte token the driver handed both sides through Ray. Until one presents
it, the receiver watches every connection at once: each has :data:`TOKEN_SECONDS` to send
its 32 bytes, one with other bytes is closed with the rest unread, and at most
:data:`MAX_PENDING` wait at once (a newer one closes the oldest), so idle or stalled
connections of outsiders cannot hold the probe up. The probe's bytes are never decoded, and
the whole exchange has one deadline: a peer that stalls makes the probe fail, not hang.
"""

from __future__ import annotations

import hmac
import secrets
import selectors
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import ray

from weightsync_core.api.hosts import default_host
from weightsync_core.plan.layout import Link

__all__ = ["ProbeReceiver", "ProbeSender", "measure_cluster_links", "measure_link"]

_TOKEN_BYTES = 32
_CHUNK = 1 << 20
PROBE_SECONDS = 60.0
"""Deadline of one probe (connection, pings and bulk transfer)."""
TOKEN_SECONDS = 1.0
"""How long a connection to the receiver has, from its accept, to present the token."""
MAX_PENDING = 16
"""Connections the receiver holds at once before they present the token."""


def _timeout_until(sock: socket.socket, deadline: float) -> None:
    """Let ``sock``'s next call wait no later than ``deadline``."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"the link probe ran past its {PROBE_SECONDS:.0f} s deadline")
    sock.settimeout(left)


def _receive_exactly(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    """``nbytes`` (a ping or an answer) from ``sock`` before ``deadline``."""
    data = bytearray()
    while len(data) < nbytes:
        _timeout_until(sock, deadline)
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("the probe's peer closed the connection")
        data += chunk
    return bytes(data)


class ProbeReceiver:
    """Listens on this node's address; echoes pings, drains the bulk transfer.

    Args:
        token_seconds: how long each connection has to present the token.
        max_pending: connections held at once before they present it; one more closes the
            oldest.
    """

    def __init__(self, token_seconds: float = TOKEN_SECONDS,
                 max_pending: int = MAX_PENDING) -> None:
        if not 0 < token_seconds < float("inf") or max_pending < 1:
            raise ValueError(f"token_seconds must be finite and > 0, max_pending >= 1; got "
                             f"{token_seconds} and {max_pending}")
        self._token_seconds = token_seconds
        self._max_pending = max_pending
        host = default_host()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family)

    def address(self) -> tuple[str, int]:
        """Where the sender connects."""
        host, port = self._listener.getsockname()[:2]
        return host, port

    def serve(self, token: bytes, pings: int, nbytes: int) -> None:
        """Serve one authenticated probe: ``pings`` one-byte echoes, then ``nbytes`` in bulk
        answered by one byte. Connections without the token are closed unread; the listener
        closes once the token's holder is in."""
        deadline = time.monotonic() + PROBE_SECONDS
        with self._authenticated(token, deadline) as connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(pings):
                _receive_exactly(connection, 1, deadline)
                connection.sendall(b"\x01")
            buffer = bytearray(_CHUNK)
            remaining = nbytes
            while remaining:
                _timeout_until(connection, deadline)
                count = connection.recv_into(buffer, min(remaining, _CHUNK))
                if not count:
                    raise ConnectionError("the probe's sender closed mid-transfer")
                remaining -= count
            connection.sendall(b"\x02")

    def _authenticated(self, token: bytes, deadline: float) -> socket.socket:
        """The first connection to present ``token``, before ``deadline``.

        Every connection is watched at once: each reads at most the token's 32 bytes, within
        ``token_seconds`` of its accept, and is closed on other bytes, an early end or its
        deadline; past ``max_pending`` connections, the oldest is closed. The rest are closed
        on return, and so is the listener."""
        pending: dict[socket.socket, tuple[float, bytearray]] = {}  # oldest first
        self._listener.setblocking(False)
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)

            def drop(connection: socket.socket) -> None:
                del pending[connection]
                selector.unregister(connection)
                connection.close()

            try:
                while True:
                    now = time.monotonic()
                    for connection in [c for c, (until, _) in pending.items() if until <= now]:
                        drop(connection)
                    if now >= deadline:
                        raise TimeoutError(
                            f"the link probe ran past its {PROBE_SECONDS:.0f} s deadline")
                    wake = min([deadline, *(until for until, _ in pending.values())])
                    for key, _ in selector.select(wake - now):
                        if key.fileobj is self._listener:
                            self._accept(pending, selector, drop)
                            continue
                        connection = key.data
                        if connection not in pending:  # dropped by an earlier event
                            continue
                        received = pending[connection][1]
                        try:
                            chunk = connection.recv(_TOKEN_BYTES - len(received))
                        except (BlockingIOError, InterruptedError):
                            continue
                        except OSError:
                            chunk = b""
                        received += chunk
                        if chunk and len(received) < _TOKEN_BYTES:
                            continue
                        complete = len(received) == _TOKEN_BYTES
                        if complete and hmac.compare_digest(bytes(received), token):
                            del pending[connection]
                            selector.unregister(connection)
                            connection.setblocking(True)
                            return connection
                        drop(connection)  # an early end or another token: its rest unread
            finally:
                for connection in list(pending):
                    drop(connection)
                selector.unregister(self._listener)
                self._listener.close()

    def _accept(self, pending: dict[socket.socket, tuple[float, bytearray]],
                selector: selectors.BaseSelector,
                drop: Callable[[socket.socket], None]) -> None:
        """Accept one waiting connection into ``pending``, closing the oldest if full."""
        try:
            connection, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        connection.setblocking(False)
        if len(pending) >= self._max_pending:
            drop(next(iter(pending)))
        pending[connection] = (time.monotonic() + self._token_seconds, bytearray())
        selector.register(connection, selectors.EVENT_READ, data=connection)


class ProbeSender:
    """Connects to a :class:`ProbeReceiver` and times pings and one bulk transfer."""

    def run(self, address: tuple[str, int], token: bytes, pings: int,
            nbytes: int) -> tuple[float, float]:
        """Returns ``(one-way latency seconds, bulk seconds)``; the bulk time runs from the
        first byte sent to the receiver's answer to the last."""
        deadline = time.monotonic() + PROBE_SECONDS
        payload = memoryview(bytes(_CHUNK))
        with socket.create_connection(address, timeout=PROBE_SECONDS) as connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection.sendall(token)
            round_trips = []
            for _ in range(pings):
                start = time.perf_counter()
                connection.sendall(b"\x01")
                _receive_exactly(connection, 1, deadline)
                round_trips.append(time.perf_counter() - start)
            start = time.perf_counter()
            remaining = nbytes
            while remaining:
                _timeout_until(connection, deadline)
                count = min(remaining, _CHUNK)
                connection.sendall(payload[:count])
                remaining -= count
            _receive_exactly(connection, 1, deadline)
            bulk = time.perf_counter() - start
        return statistics.median(round_trips) / 2, bulk


def measure_link(
    sender_options: dict[str, Any], receiver_options: dict[str, Any],
    nbytes: int = 64 << 20, pings: int = 20,
) -> Link:
    """Probe the link between a sender and a receiver placed by the given Ray actor
    options (e.g. a node affinity): median one-way latency of ``pings`` one-byte round
    trips, and the bandwidth of one ``nbytes`` stream (its time less one round trip)."""
    if nbytes < _CHUNK or pings < 1:
        raise ValueError(f"probe at least {_CHUNK} bytes and 1 ping, got {nbytes} and {pings}")
    token = secrets.token_bytes(_TOKEN_BYTES)
    # Ray's stubs type an actor handle's methods as plain functions (no ``.remote``)
    receiver: Any = ray.remote(ProbeReceiver).options(num_cpus=0, **receiver_options).remote()
    sender: Any = ray.remote(ProbeSender).options(num_cpus=0, **sender_options).remote()
    limit = 2 * PROBE_SECONDS  # actor placement and start, then the probe's own deadline
    try:
        address = ray.get(receiver.address.remote(), timeout=limit)
        served = receiver.serve.remote(token, pings, nbytes)
        latency, bulk = ray.get(sender.run.remote(address, token, pings, nbytes), timeout=limit)
        ray.get(served, timeout=limit)
    finally:
        for handle in (sender, receiver):
            ray.kill(handle)
    return Link(bandwidth=nbytes / max(bulk - 2 * latency, 1e-9), latency=latency)


def measure_cluster_links(nbytes: int = 64 << 20) -> tuple[Link, Link]:
    """Probe the connected Ray cluster: the NIC between the first two alive nodes, and
    loopback on the first (TCP between two processes of one node; give NVLink figures by
    hand for GPUs). Needs ``ray.init`` first and at least two nodes."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
    if len(nodes) < 2:
        raise ValueError(
            f"--measure needs a Ray cluster of at least two nodes to probe a NIC, found "
            f"{len(nodes)}; connect to one (--address) or give --nic-gbit by hand"
        )

    def on(node: str) -> dict[str, Any]:
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    return measure_link(on(nodes[0]), on(nodes[1]), nbytes), measure_link(
        on(nodes[0]), on(nodes[0]), nbytes)
