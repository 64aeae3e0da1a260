"""The ZeroMQ control channel between engine processes (real sockets on loopback)."""

import asyncio
import os
import pickle

import msgspec
import pytest
import zmq
import zmq.asyncio

from weightsync_core.api.session_key import new_session_key
from weightsync_core.net.channel import (
    _ENVELOPES,
    FRAGMENT_BYTES,
    MAX_FRAME_BYTES,
    ControlChannel,
    _Envelope,
    zmq_endpoint,
)
from weightsync_core.net.wire import MessageCodec, MessageSealer


class Note(msgspec.Struct, tag="note", frozen=True):
    index: int


class Other(msgspec.Struct, tag="other", frozen=True):
    text: str


class Bulky(msgspec.Struct, tag="bulky", frozen=True):
    data: bytes


def frame(key: bytes, body: bytes, recipient: str, seq: int = 0,
          sender: str = "tcp://127.0.0.1:1", last: bool = True) -> bytes:
    """A frame as a member holding ``key`` would seal it."""
    return MessageSealer(key).seal(_ENVELOPES.encode(_Envelope(sender, recipient, seq, last,
                                                               body)))


def outsider_push(endpoint: str) -> zmq.Socket:
    """A PUSH socket connected to ``endpoint``, as a process outside the sync would open, in
    a context of its own: ``push.context.destroy(linger=0)`` closes both."""
    push = zmq.Context().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(endpoint)
    return push


def channels(key: bytes | None = None) -> tuple[ControlChannel, ControlChannel]:
    key = key or new_session_key()
    pair = ControlChannel("127.0.0.1", Note), ControlChannel("127.0.0.1", Note)
    for channel in pair:
        channel.use_key(key)
    return pair


def test_endpoints_bracket_ipv6_hosts():
    assert zmq_endpoint("10.0.0.1", 5) == "tcp://10.0.0.1:5"
    assert zmq_endpoint("::1", 5) == "tcp://[::1]:5"


def test_messages_arrive_in_order_and_waits_time_out():
    async def scenario():
        sender, receiver = channels()
        try:
            for index in range(3):
                await sender.send(receiver.endpoint, Note(index), timeout=5)
            assert [(await receiver.receive(5)).index for _ in range(3)] == [0, 1, 2]
            with pytest.raises(TimeoutError):
                await receiver.receive(0.2)
        finally:
            sender.close()
            receiver.close()

    asyncio.run(scenario())


def test_sending_to_a_peer_that_is_not_there_times_out():
    async def scenario():
        channel, absent = channels()
        endpoint = absent.endpoint
        absent.close()
        try:
            with pytest.raises(TimeoutError):
                await channel.send(endpoint, Note(0), timeout=0.5)
        finally:
            channel.close()

    asyncio.run(scenario())


class _Marker:
    """Unpickling this creates a file: the proof that a payload ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_unauthenticated_and_malformed_frames_are_dropped_never_decoded(tmp_path):
    marker = tmp_path / "pwned"
    key = new_session_key()

    async def scenario():
        sender, receiver = channels(key)
        push = outsider_push(receiver.endpoint)
        try:
            payload = pickle.dumps({"kind": "credit", "x": _Marker(str(marker))})
            push.send(payload)  # a pickle, as 0.2.0 would have decoded it
            push.send(MessageSealer(new_session_key()).seal(payload))  # someone else's key
            push.send(b"")  # empty frame
            wrong_schema = MessageCodec(Other).encode(Other("hi"))
            to = receiver.endpoint
            push.send(frame(key, wrong_schema, to, seq=0))  # authentic but not a Note
            push.send(MessageSealer(key).seal(b"\xc1\xc1"))  # authentic but not MessagePack
            note = MessageCodec(Note).encode(Note(7))
            push.send(MessageSealer(key).seal(note))  # authentic, but no envelope
            # a valid note on the same connection arrives after all of them
            push.send(frame(key, note, to, seq=1))
            assert (await receiver.receive(5)).index == 7
            assert receiver.rejected == 6
        finally:
            push.context.destroy(linger=0)
            sender.close()
            receiver.close()

    asyncio.run(scenario())
    assert not marker.exists()


def test_late_messages_of_an_earlier_sync_are_dropped_quietly():
    async def scenario():
        sender, receiver = channels()
        try:
            await sender.send(receiver.endpoint, Note(1), timeout=5)
            receiver.use_key(new_session_key())  # the next sync
            with pytest.raises(TimeoutError):
                await receiver.receive(0.5)
            assert (receiver.stale, receiver.rejected) == (1, 0)  # late, not forged
        finally:
            sender.close()
            receiver.close()

    asyncio.run(scenario())


def test_the_inbox_listens_on_its_host_only_and_closes():
    import psutil

    channel = ControlChannel("127.0.0.1", Note)
    port = channel.port
    listening = {c.laddr.ip for c in psutil.Process(os.getpid()).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert listening == {"127.0.0.1"}
    channel.close()
    assert not [c for c in psutil.Process(os.getpid()).net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    with pytest.raises(ValueError, match="binds to one address"):
        ControlChannel("0.0.0.0", Note)


def test_replayed_duplicated_and_misaddressed_frames_are_dropped():
    """A captured frame re-sent later, a frame sent twice, and a frame of another process's
    traffic never reach the engine, even though each carries the sync's tag."""
    key = new_session_key()

    async def scenario():
        sender, receiver = channels(key)
        other = ControlChannel("127.0.0.1", Note)
        other.use_key(key)
        push = outsider_push(receiver.endpoint)
        captured: list[bytes] = []  # what the member really puts on the wire
        original = zmq.asyncio.Socket.send

        async def recording(self, data, *args, **kwargs):
            captured.append(bytes(data))
            return await original(self, data, *args, **kwargs)

        zmq.asyncio.Socket.send = recording  # type: ignore[method-assign]
        try:
            await sender.send(receiver.endpoint, Note(1), timeout=5)
            await sender.send(other.endpoint, Note(2), timeout=5)
        finally:
            zmq.asyncio.Socket.send = original  # type: ignore[method-assign]
        try:
            assert (await receiver.receive(5)).index == 1
            assert (await other.receive(5)).index == 2
            push.send(captured[0])  # a replay of the frame the receiver already took
            push.send(captured[1])  # a frame of the sender's traffic to another process
            await sender.send(receiver.endpoint, Note(3), timeout=5)
            assert (await receiver.receive(5)).index == 3
            with pytest.raises(TimeoutError):
                await receiver.receive(0.3)
            assert (receiver.replayed, receiver.rejected) == (1, 1)
        finally:
            push.context.destroy(linger=0)
            for channel in (sender, receiver, other):
                channel.close()

    asyncio.run(scenario())


def test_messages_larger_than_a_frame_travel_in_fragments_and_in_order():
    async def scenario():
        key = new_session_key()
        sender = ControlChannel("127.0.0.1", Bulky)
        receiver = ControlChannel("127.0.0.1", Bulky)
        for channel in (sender, receiver):
            channel.use_key(key)
        try:
            sizes = [3 * FRAGMENT_BYTES + 5, 10, 0, FRAGMENT_BYTES]
            payloads = [os.urandom(size) for size in sizes]
            # sent concurrently: each message's fragments stay together and in order
            await asyncio.gather(*(sender.send(receiver.endpoint, Bulky(payload), timeout=5)
                                   for payload in payloads))
            received = [(await receiver.receive(5)).data for _ in payloads]
            assert received == payloads
        finally:
            sender.close()
            receiver.close()

    asyncio.run(scenario())


def test_a_frame_over_the_limit_is_refused_before_it_is_buffered():
    """ZeroMQ drops a peer that sends a frame over MAX_FRAME_BYTES; members still get
    through."""
    async def scenario():
        sender, receiver = channels()
        push = outsider_push(receiver.endpoint)
        try:
            push.send(b"\x00" * (MAX_FRAME_BYTES + 1))
            await sender.send(receiver.endpoint, Note(4), timeout=5)
            assert (await receiver.receive(5)).index == 4
            assert receiver.rejected == 0  # never even read
        finally:
            push.context.destroy(linger=0)
            sender.close()
            receiver.close()

    asyncio.run(scenario())
