"""The ZeroMQ control channel between engine processes (real sockets on loopback)."""

import asyncio
import os
import pickle

import msgspec
import pytest
import zmq

from weightsync_core.channel import ControlChannel, zmq_endpoint
from weightsync_core.wire import MessageCodec, MessageSealer, new_session_key


class Note(msgspec.Struct, tag="note", frozen=True):
    index: int


class Other(msgspec.Struct, tag="other", frozen=True):
    text: str


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
        outsider = zmq.Context()
        push = outsider.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(receiver.endpoint)
        try:
            payload = pickle.dumps({"kind": "credit", "x": _Marker(str(marker))})
            push.send(payload)  # a pickle, as 0.2.0 would have decoded it
            push.send(MessageSealer(new_session_key()).seal(payload))  # someone else's key
            push.send(b"")  # empty frame
            wrong_schema = MessageCodec(Other).encode(Other("hi"))
            push.send(MessageSealer(key).seal(wrong_schema))  # authentic but not a Note
            push.send(MessageSealer(key).seal(b"\xc1\xc1"))  # authentic but not MessagePack
            # a valid note on the same connection arrives after all of them
            push.send(MessageSealer(key).seal(MessageCodec(Note).encode(Note(7))))
            assert (await receiver.receive(5)).index == 7
            assert receiver.rejected == 5
        finally:
            push.close()
            outsider.term()
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
