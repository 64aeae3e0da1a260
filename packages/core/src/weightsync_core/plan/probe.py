"""``--measure``: probe a link's bandwidth and latency between two Ray actors over TCP.

The receiver listens on its own node's address only and serves one connection that opens
with a random 32-byte token the driver handed both sides through Ray; anything else is
dropped unread. The probe's bytes are never decoded.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import statistics
import time
from typing import Any

import ray

from weightsync_core.plan.layout import Link
from weightsync_core.process_group import default_host

__all__ = ["measure_cluster_links", "measure_link"]

_TOKEN_BYTES = 32
_CHUNK = 1 << 20
_ACCEPT_SECONDS = 60.0


def _receive_exactly(sock: socket.socket, nbytes: int) -> bytes:
    """``nbytes`` (a token or a ping) from ``sock``."""
    data = bytearray()
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("the probe's peer closed the connection")
        data += chunk
    return bytes(data)


class ProbeReceiver:
    """Listens on this node's address; echoes pings, drains the bulk transfer."""

    def __init__(self) -> None:
        self._listener = socket.create_server((default_host(), 0))
        self._listener.settimeout(_ACCEPT_SECONDS)

    def address(self) -> tuple[str, int]:
        """Where the sender connects."""
        host, port = self._listener.getsockname()[:2]
        return host, port

    def serve(self, token: bytes, pings: int, nbytes: int) -> None:
        """Serve one authenticated probe: ``pings`` one-byte echoes, then ``nbytes`` in bulk
        answered by one byte. Connections without the token are closed unread."""
        deadline = time.monotonic() + _ACCEPT_SECONDS
        while True:
            self._listener.settimeout(max(0.1, deadline - time.monotonic()))
            connection, _ = self._listener.accept()
            with connection:
                connection.settimeout(_ACCEPT_SECONDS)
                try:
                    presented = _receive_exactly(connection, _TOKEN_BYTES)
                except (ConnectionError, TimeoutError):
                    continue
                if not hmac.compare_digest(presented, token):
                    continue
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for _ in range(pings):
                    _receive_exactly(connection, 1)
                    connection.sendall(b"\x01")
                buffer = bytearray(_CHUNK)
                remaining = nbytes
                while remaining:
                    count = connection.recv_into(buffer, min(remaining, _CHUNK))
                    if not count:
                        raise ConnectionError("the probe's sender closed mid-transfer")
                    remaining -= count
                connection.sendall(b"\x02")
                return

    def close(self) -> None:
        """Stop listening."""
        self._listener.close()


class ProbeSender:
    """Connects to a :class:`ProbeReceiver` and times pings and one bulk transfer."""

    def run(self, address: tuple[str, int], token: bytes, pings: int,
            nbytes: int) -> tuple[float, float]:
        """Returns ``(one-way latency seconds, bulk seconds)``."""
        payload = memoryview(bytes(_CHUNK))
        with socket.create_connection(address, timeout=_ACCEPT_SECONDS) as connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection.sendall(token)
            round_trips = []
            for _ in range(pings):
                start = time.perf_counter()
                connection.sendall(b"\x01")
                _receive_exactly(connection, 1)
                round_trips.append(time.perf_counter() - start)
            start = time.perf_counter()
            remaining = nbytes
            while remaining:
                count = min(remaining, _CHUNK)
                connection.sendall(payload[:count])
                remaining -= count
            _receive_exactly(connection, 1)
            bulk = time.perf_counter() - start
        return statistics.median(round_trips) / 2, bulk


def measure_link(
    sender_options: dict[str, Any], receiver_options: dict[str, Any],
    nbytes: int = 64 << 20, pings: int = 20,
) -> Link:
    """Probe the link between a sender and a receiver placed by the given Ray actor
    options (e.g. a node affinity): median one-way latency of ``pings`` one-byte round
    trips, and the bandwidth of one ``nbytes`` stream."""
    if nbytes < _CHUNK or pings < 1:
        raise ValueError(f"probe at least {_CHUNK} bytes and 1 ping, got {nbytes} and {pings}")
    token = secrets.token_bytes(_TOKEN_BYTES)
    receiver = ray.remote(ProbeReceiver).options(num_cpus=0, **receiver_options).remote()
    sender = ray.remote(ProbeSender).options(num_cpus=0, **sender_options).remote()
    try:
        address = ray.get(receiver.address.remote())
        served = receiver.serve.remote(token, pings, nbytes)
        latency, bulk = ray.get(sender.run.remote(address, token, pings, nbytes))
        ray.get(served)
    finally:
        for handle in (sender, receiver):
            ray.kill(handle)
    return Link(bandwidth=nbytes / max(bulk - latency, 1e-9), latency=latency)


def measure_cluster_links(nbytes: int = 64 << 20) -> tuple[Link, Link]:
    """Probe the connected Ray cluster: the NIC between the first two alive nodes that can
    run actors, and the intra-host link on the first (over loopback TCP; pass NVLink
    figures by hand for GPUs). Needs ``ray.init`` first and at least two nodes."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
    if len(nodes) < 2:
        raise RuntimeError(
            f"--measure needs a Ray cluster of at least two nodes to probe a NIC, found "
            f"{len(nodes)}; connect to one (RAY_ADDRESS) or give --nic-gbit by hand"
        )

    def on(node: str) -> dict[str, Any]:
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    nic = measure_link(on(nodes[0]), on(nodes[1]), nbytes)
    intra = measure_link(on(nodes[0]), on(nodes[0]), nbytes)
    return nic, intra
