"""The ZeroMQ control channel between engine processes (real sockets on loopback)."""

import asyncio

import pytest

from weightsync_core.channel import ControlChannel, zmq_endpoint


def test_endpoints_bracket_ipv6_hosts():
    assert zmq_endpoint("10.0.0.1", 5) == "tcp://10.0.0.1:5"
    assert zmq_endpoint("::1", 5) == "tcp://[::1]:5"


def test_messages_arrive_in_order_and_waits_time_out():
    async def scenario():
        sender, receiver = ControlChannel("127.0.0.1"), ControlChannel("127.0.0.1")
        try:
            for index in range(3):
                await sender.send(receiver.endpoint, {"index": index}, timeout=5)
            assert [(await receiver.receive(5))["index"] for _ in range(3)] == [0, 1, 2]
            with pytest.raises(TimeoutError):
                await receiver.receive(0.2)
        finally:
            sender.close()
            receiver.close()

    asyncio.run(scenario())


def test_sending_to_a_peer_that_is_not_there_times_out():
    async def scenario():
        channel = ControlChannel("127.0.0.1")
        absent = ControlChannel("127.0.0.1")
        endpoint = absent.endpoint
        absent.close()
        try:
            with pytest.raises(TimeoutError):
                await channel.send(endpoint, {"kind": "hello"}, timeout=0.5)
        finally:
            channel.close()

    asyncio.run(scenario())
