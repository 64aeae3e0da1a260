"""A ring process whose earlier sync's session still reads its control channel (the caller's
cancellation has not arrived) must not lose what a neighbour sends for the next sync before
this process opens that sync's session: the testbed's sync after a healed partition failed
with two neighbours waiting on each other for a ``hello`` the lingering reader had dropped."""

from __future__ import annotations

import asyncio
import os
from collections import deque

import torch

from weightsync_core.api.engine import SyncProgress
from weightsync_core.api.passes import PassTimes
from weightsync_core.data.topology import RingPlacement
from weightsync_core.engines.ring.messages import Hello, RingMessage
from weightsync_core.engines.ring.session import EARLY_MESSAGES, RingLink, RingSession
from weightsync_core.engines.ring.slots import RegisteredSlots
from weightsync_core.net.channel import ControlChannel, PeerEndpoints

HOST = "127.0.0.1"


def _no_transport() -> None:
    raise AssertionError("a hello moves on the control channel only")


def _link(endpoints: PeerEndpoints, early: deque[RingMessage] | None = None) -> RingLink:
    """A link of this process; ``early``: the engine's, shared by its sessions."""
    slots = RegisteredSlots(lambda: torch.empty(0, dtype=torch.uint8), _no_transport)
    return RingLink(endpoints, slots, torch.device("cpu"), 2.0, SyncProgress(),
                    "rollout rank 0", deque(maxlen=EARLY_MESSAGES) if early is None else early,
                    PassTimes())


def _placement(sync_id: str, downstream: str) -> RingPlacement:
    return RingPlacement(position=1, sync_id=sync_id, upstream=None, downstream=downstream,
                         downstream_name="rollout rank 1")


def test_the_next_syncs_hello_read_by_a_lingering_session_reaches_the_next_session() -> None:
    key = os.urandom(32)

    async def scenario() -> Hello:
        here = PeerEndpoints(HOST, _no_transport, RingMessage)
        neighbour: ControlChannel[RingMessage] = ControlChannel(HOST, RingMessage)
        try:
            here.channel.use_key(key)
            neighbour.use_key(key)
            first = _link(here)
            lingering = RingSession(first, _placement("sync-1", neighbour.endpoint))
            # the neighbour has joined sync 2 and says hello before this process opens it
            await neighbour.send(here.channel.endpoint, Hello("sync-2", {"at": 1}, []), 2.0)
            await asyncio.sleep(0.5)  # the lingering session's reader takes it
            lingering.supersede()
            await lingering.close()
            following = RingSession(_link(here, first.early),
                                    _placement("sync-2", neighbour.endpoint))
            try:
                return await following.wait(asyncio.shield(following._hello), timeout=2.0,
                                            on_timeout="waiting for its hello",
                                            peer="rollout rank 1")
            finally:
                await following.close()
        finally:
            neighbour.close()
            here.close()

    hello = asyncio.run(scenario())
    assert hello.sync == "sync-2"
    assert hello.peer == {"at": 1}


def test_a_session_keeps_only_its_own_syncs_early_messages() -> None:
    async def scenario() -> tuple[list[str], int]:
        link = _link(PeerEndpoints(HOST, _no_transport, RingMessage))
        for sync in ("sync-0", "sync-5", "sync-0"):
            link.early.append(Hello(sync, None, []))
        session = RingSession(link, _placement("sync-5", "tcp://127.0.0.1:1"))
        try:
            taken = [session._hello.result().sync] if session._hello.done() else []
            return taken, len(link.early)
        finally:
            await session.close()

    taken, left = asyncio.run(scenario())
    assert taken == ["sync-5"]
    assert left == 0, "another sync's leftovers are dropped when a session opens"


def test_early_messages_are_bounded() -> None:
    link = _link(PeerEndpoints(HOST, _no_transport, RingMessage))
    for index in range(EARLY_MESSAGES + 10):
        link.early.append(Hello(f"sync-{index}", None, []))
    assert len(link.early) == EARLY_MESSAGES

