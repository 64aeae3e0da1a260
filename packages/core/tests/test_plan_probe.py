"""``weightsync plan --measure``'s probe: real sockets between real Ray actors."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from weightsync_core.orchestration.local_ray import CONNECT_SECONDS
from weightsync_core.plan.probe import ProbeReceiver, ProbeSender, measure_link


def test_probe_measures_a_link_between_two_actors():
    link = measure_link({}, {}, nbytes=8 << 20, pings=5)
    assert link.bandwidth > 1e6  # loopback: far above a megabyte a second
    assert 0 <= link.latency < 0.1


def test_probe_listens_on_the_configured_host_and_drops_strangers_unread():
    receiver = ray.remote(ProbeReceiver).options(num_cpus=0).remote()
    sender = ray.remote(ProbeSender).options(num_cpus=0).remote()
    try:
        host, port = ray.get(receiver.address.remote())
        assert host not in ("0.0.0.0", "::", "")
        token = secrets.token_bytes(32)
        served = receiver.serve.remote(token, 2, 1 << 20)
        with socket.create_connection((host, port), timeout=30) as stranger:
            stranger.sendall(b"x" * 32 + b"more bytes that must never be read")
            try:
                answer = stranger.recv(1)
            except ConnectionResetError:  # closed with the stranger's bytes unread
                answer = b""
            assert answer == b""
        latency, bulk = ray.get(sender.run.remote((host, port), token, 2, 1 << 20))
        ray.get(served, timeout=60)
        assert latency >= 0 and bulk > 0
    finally:
        for handle in (sender, receiver):
            ray.kill(handle)


def _ready_pair(**receiver_options):
    """A started receiver and sender; the receiver's address."""
    receiver = ray.remote(ProbeReceiver).options(num_cpus=0).remote(**receiver_options)
    sender = ray.remote(ProbeSender).options(num_cpus=0).remote()
    address = ray.get(receiver.address.remote(), timeout=60)
    ray.get(sender.__ray_ready__.remote(), timeout=60)
    return receiver, sender, address


def _closed_by_peer(connection: socket.socket, within: float) -> bool:
    """Whether ``connection``'s peer closes it within ``within`` seconds."""
    connection.settimeout(within)
    try:
        return connection.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _timed_probe(stragglers: bool) -> tuple[float, bool]:
    """Seconds of one probe (the sender's run and the receiver's end), with or without an
    idle and a half-token connection opened before it and held open; whether the receiver
    has closed those by then."""
    receiver, sender, address = _ready_pair()
    token = secrets.token_bytes(32)
    held: list[socket.socket] = []
    try:
        served = receiver.serve.remote(token, 5, 8 << 20)
        if stragglers:
            held.append(socket.create_connection(address, timeout=30))  # says nothing
            held.append(socket.create_connection(address, timeout=30))
            held[1].sendall(token[:16])  # the right first half, then it stalls
            time.sleep(0.5)  # in the receiver's queue before the sender's connection
        start = time.monotonic()
        latency, bulk = ray.get(sender.run.remote(address, token, 5, 8 << 20), timeout=150)
        ray.get(served, timeout=150)
        seconds = time.monotonic() - start
        assert latency >= 0 and bulk > 0
        return seconds, all(_closed_by_peer(connection, 5) for connection in held)
    finally:
        for connection in held:
            connection.close()
        for handle in (sender, receiver):
            ray.kill(handle)


def test_idle_and_half_token_connections_do_not_hold_the_probe_up():
    alone, _ = _timed_probe(stragglers=False)
    beside, closed = _timed_probe(stragglers=True)
    print(f"probe alone {alone:.2f} s, beside an idle and a half-token connection "
          f"{beside:.2f} s")
    # before: the receiver read the idle one until its 60 s deadline, and the probe failed
    assert beside < alone + 2, (alone, beside)
    assert closed  # closed by the receiver, not left open


def test_a_connection_that_never_sends_the_token_is_closed_after_its_token_deadline():
    receiver, sender, address = _ready_pair(token_seconds=1.0)
    token = secrets.token_bytes(32)
    try:
        served = receiver.serve.remote(token, 1, 1 << 20)
        with socket.create_connection(address, timeout=30) as idle:
            start = time.monotonic()
            assert _closed_by_peer(idle, 10)
            assert 0.5 < time.monotonic() - start < 5
        ray.get(sender.run.remote(address, token, 1, 1 << 20), timeout=60)
        ray.get(served, timeout=60)
    finally:
        for handle in (sender, receiver):
            ray.kill(handle)


def test_unauthenticated_connections_held_at_once_are_bounded():
    # a long token deadline: only the bound closes a connection here
    receiver, sender, address = _ready_pair(token_seconds=30.0, max_pending=2)
    token = secrets.token_bytes(32)
    try:
        served = receiver.serve.remote(token, 1, 1 << 20)
        idle = [socket.create_connection(address, timeout=30) for _ in range(3)]
        try:
            assert _closed_by_peer(idle[0], 10)  # the third closed the oldest
            assert not _closed_by_peer(idle[1], 0.5) and not _closed_by_peer(idle[2], 0.5)
            ray.get(sender.run.remote(address, token, 1, 1 << 20), timeout=60)
            ray.get(served, timeout=60)
            # once the token's holder is in, the others and the listener are closed
            assert _closed_by_peer(idle[2], 10)
        finally:
            for connection in idle:
                connection.close()
        with pytest.raises(OSError):
            socket.create_connection(address, timeout=10).close()
    finally:
        for handle in (sender, receiver):
            ray.kill(handle)


def test_measure_at_an_unreachable_address_fails_fast_with_one_line():
    with socket.socket() as held:  # bound, not listening: connections are refused
        held.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{held.getsockname()[1]}"
        env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
        start = time.monotonic()
        result = subprocess.run(
            [str(Path(sys.executable).parent / "weightsync"), "plan", "--measure",
             "--address", address, "--model-gb", "1"],
            env=env, capture_output=True, text=True, timeout=150,
        )
        seconds = time.monotonic() - start
    # before: Ray retried the address for many minutes, then a traceback
    assert result.returncode == 1, result.stderr[-2000:]
    assert seconds < CONNECT_SECONDS + 20, seconds  # interpreter and imports included
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"weightsync plan: no Ray cluster answers at {address}: Connection refused "
        f"(waited at most {CONNECT_SECONDS:.0f} s)"
    ]
