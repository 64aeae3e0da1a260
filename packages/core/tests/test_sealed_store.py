"""The broadcast engines' rendezvous store, attacked by an outsider on the same host who holds
no key: it can neither list, read nor write anything, nor replay a member's request, and
junk, oversized and idle connections cost the server little and never keep members out."""

import contextlib
import datetime
import os
import socket
import struct
import threading
import time

import pytest
import torch.distributed as dist

from weightsync_core.api.session_key import new_session_key
from weightsync_core.net.process_group import create_store, listen_on_free_port
from weightsync_core.net.sealed_store import (
    MAX_CONNECTIONS,
    MAX_FRAME_BYTES,
    REQUEST_SECONDS,
    SealedStore,
    SealedStoreServer,
)


@pytest.fixture
def served():
    """A store served on loopback, and a member's client of it."""
    key = new_session_key()
    listener = listen_on_free_port("127.0.0.1")
    port = listener.getsockname()[1]
    server = SealedStoreServer(listener, key, timeout=5.0)
    client = SealedStore("127.0.0.1", port, key, timeout=5.0)
    client.set("weightsync/control/0", b"address of rank 0")
    yield server, client, port
    server.close()


def test_members_use_it_as_a_torch_store(served):
    _, client, _ = served
    prefixed = dist.PrefixStore("group", client)
    prefixed.set("a", "1")
    assert prefixed.get("a") == b"1"
    assert prefixed.add("counter", 2) == 2 and prefixed.add("counter", 3) == 5
    assert prefixed.check(["a", "counter"]) and not prefixed.check(["missing"])
    assert prefixed.compare_set("a", "1", "2") == b"2"
    assert prefixed.compare_set("a", "1", "3") == b"2"
    assert prefixed.delete_key("a") and not prefixed.check(["a"])
    later = threading.Timer(0.3, prefixed.set, args=("late", "x"))
    later.start()
    prefixed.wait(["late"], datetime.timedelta(seconds=5))  # blocks until it is set
    with pytest.raises(dist.DistStoreError, match="not set within"):
        prefixed.wait(["never"], datetime.timedelta(seconds=0.3))


def test_a_torch_store_client_without_the_key_gets_nothing(served):
    server, client, port = served

    def claim() -> None:
        outsider = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=1),
            wait_for_workers=False)
        outsider.set("weightsync/arrived/2", "1")
        raise AssertionError(f"the outsider listed {outsider.list_keys()}")

    with pytest.raises((RuntimeError, dist.DistStoreError)):
        claim()
    assert not client.check(["weightsync/arrived/2"])
    assert server.rejected >= 1


def test_requests_sealed_with_another_key_or_replayed_are_refused(served):
    server, client, port = served
    stranger = SealedStore("127.0.0.1", port, new_session_key(), timeout=1.0)
    with pytest.raises(dist.DistStoreError, match="did not answer"):
        stranger.get("weightsync/control/0")
    with pytest.raises(dist.DistStoreError):
        stranger.set("weightsync/arrived/1", b"1")
    captured = []
    real_sendall = socket.socket.sendall

    def recording(self, data, *args):
        captured.append(bytes(data))
        return real_sendall(self, data, *args)

    socket.socket.sendall = recording  # type: ignore[method-assign]
    try:
        client.set("weightsync/arrived/0", b"1")
    finally:
        socket.socket.sendall = real_sendall  # type: ignore[method-assign]
    client.delete_key("weightsync/arrived/0")
    rejected = server.rejected
    with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_SECONDS + 2) as replay:
        replay.sendall(captured[-1])
        assert replay.recv(1) == b""  # closed unanswered
    assert server.rejected == rejected + 1
    assert not client.check(["weightsync/arrived/0"])


def test_junk_oversized_and_idle_connections_are_closed_and_members_get_through(served):
    _, client, port = served
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as oversized:
        oversized.sendall(struct.pack("!I", MAX_FRAME_BYTES + 1) + b"\x00" * 100)
        assert oversized.recv(1) == b""  # closed before the frame was read
    with socket.create_connection(("127.0.0.1", port)) as junk:
        junk.sendall(os.urandom(4096))
        assert junk.recv(1) == b""
    assert time.monotonic() - start < 1
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS + 50)]
    try:
        started = time.monotonic()
        assert client.get("weightsync/control/0") == b"address of rank 0"
        assert time.monotonic() - started < 1, "a flood of idle connections held a member up"
        time.sleep(REQUEST_SECONDS + 0.5)
        assert all(sock.recv(1) == b"" for sock in idle[-5:]), "idle connections stay open"
    finally:
        for sock in idle:
            sock.close()


def test_a_kept_group_store_stops_when_the_group_goes():
    key = new_session_key()
    listener = listen_on_free_port("127.0.0.1")
    port = listener.getsockname()[1]
    store = create_store("127.0.0.1", port, 0, 1, 2.0, "group", key, listener)
    store.store.set("x", "1")
    store.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_a_member_waiting_when_the_store_closes_learns_what_is_missing(served):
    """Rank 0 gives up first (its group failed) while another rank still waits: that rank
    is answered with the keys that never came, not left with a closed connection."""
    server, client, _ = served
    client.set("arrived/0", b"1")
    client.set("arrived/1", b"1")
    closer = threading.Timer(0.5, server.close)
    closer.start()
    start = time.monotonic()
    missing = client.missing_after(["arrived/0", "arrived/1", "arrived/2"], 5.0)
    assert missing == ["arrived/2"]
    assert time.monotonic() - start < 2.5
    closer.join()


def _delaying_proxy(port: int, delay: float) -> tuple[socket.socket, threading.Thread]:
    """A loopback relay to ``port`` that holds the first connection's bytes for ``delay``
    seconds (a request slowed by TCP retransmissions on a lossy link) and relays every
    later connection at once; closes follow in both directions."""
    listener = socket.create_server(("127.0.0.1", 0))

    def pipe(source: socket.socket, target: socket.socket, hold: float) -> None:
        with source, target, contextlib.suppress(OSError):
            time.sleep(hold)
            while chunk := source.recv(1 << 16):
                target.sendall(chunk)
            target.shutdown(socket.SHUT_WR)

    def relay() -> None:
        for index in range(2):
            client, _ = listener.accept()
            upstream = socket.create_connection(("127.0.0.1", port))
            hold = delay if index == 0 else 0.0
            threading.Thread(target=pipe, args=(client, upstream.dup(), hold),
                             daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, client.dup(), 0.0),
                             daemon=True).start()

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    return listener, thread


def test_a_request_held_up_past_the_request_deadline_is_sent_again():
    """On a lossy link a request can reach the store after REQUEST_SECONDS; the store closes
    it unanswered (it never took it) and the member sends it again, under a new nonce."""
    key = new_session_key()
    store_listener = listen_on_free_port("127.0.0.1")
    server = SealedStoreServer(store_listener, key, timeout=10.0)
    listener, relay = _delaying_proxy(store_listener.getsockname()[1], REQUEST_SECONDS + 0.5)
    try:
        with listener:
            member = SealedStore("127.0.0.1", listener.getsockname()[1], key, timeout=10.0)
            member.set("weightsync/arrived/1", b"1")
            relay.join(timeout=5)
        assert server.rejected == 1, "the held-up request should have been closed unanswered"
        direct = SealedStore("127.0.0.1", store_listener.getsockname()[1], key, timeout=10.0)
        assert direct.get("weightsync/arrived/1") == b"1"
    finally:
        server.close()
