"""One ring sync's control traffic in one process: where the process sits in the ring, the
inbox reader that routes messages, bounded waits that fail fast, and the connection to the
downstream neighbour."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync_core.blocking import run_blocking
from weightsync_core.engines.ring.messages import (
    Abort,
    BucketReady,
    Credit,
    Final,
    Hello,
    RingMessage,
)
from weightsync_core.engines.ring.slots import Downstream
from weightsync_core.errors import TransferError

if TYPE_CHECKING:
    from weightsync_core.engines.ring.engine import RingCheckpointEngine

__all__ = ["Placement", "RingSession"]


@dataclass(frozen=True)
class Placement:
    """This process's place in one sync's ring (from
    :func:`~weightsync_core.topology.ring_topology`)."""

    position: int
    sync_id: str
    upstream: str | None
    upstream_name: str | None
    downstream: str | None
    downstream_name: str | None


class RingSession:
    """One sync's control traffic in this process: routes inbox messages to the main loop
    (from upstream) or to the slot credits (from downstream), and fails fast when any
    background task of the sync fails."""

    def __init__(self, engine: RingCheckpointEngine, placement: Placement) -> None:
        self.engine = engine
        self.placement = placement
        self.from_upstream: asyncio.Queue[BucketReady | Final | Abort] = asyncio.Queue()
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._hello: asyncio.Future[Hello] = asyncio.get_running_loop().create_future()
        self._downstream: Downstream | None = None
        self._connecting: asyncio.Lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._reader = asyncio.ensure_future(self._read_inbox())

    # -- background work -----------------------------------------------------------------
    def spawn(self, coroutine) -> asyncio.Task:
        """Run ``coroutine`` in the background; its failure fails the session."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.fail(task.exception())

    def fail(self, exc: BaseException) -> None:
        """Make every wait of this session raise ``exc`` (the first failure wins)."""
        if not self.failed.done():
            self.failed.set_exception(exc)
            self.failed.exception()  # reported through the waits, not the loop's handler

    async def wait(self, awaitable, *, timeout: float, on_timeout: str, peer: str) -> Any:
        """Await ``awaitable``, but raise as soon as the session fails, and raise a
        :class:`TransferError` naming ``peer`` and the stage after ``timeout`` seconds."""
        task = asyncio.ensure_future(awaitable)
        try:
            with self.engine.progress.waiting_on(peer, on_timeout):
                done, _ = await asyncio.wait(
                    {task, self.failed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
        except BaseException:
            task.cancel()
            raise
        if task in done:
            return task.result()
        task.cancel()
        if self.failed.done():
            raise self.failed.exception()
        raise TransferError(
            f"{self.engine.describe(self.placement)} waited {timeout:.0f}s for {peer} "
            f"({on_timeout}); is it alive? (sync_timeout_seconds bounds every wait)",
            peer=peer, stage=on_timeout,
        )

    async def _read_inbox(self) -> None:
        channel = self.engine.channel
        try:
            while True:
                message: RingMessage = await channel.receive()
                if message.sync != self.placement.sync_id:
                    continue  # a leftover of an earlier, aborted sync
                if isinstance(message, BucketReady | Final | Abort):
                    self.from_upstream.put_nowait(message)
                elif isinstance(message, Hello) and not self._hello.done():
                    self._hello.set_result(message)
                elif isinstance(message, Credit) and self._downstream is not None:
                    self._downstream.take_credit(message, self.placement.downstream_name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a member broke the protocol: nothing else is in order
            self.fail(exc)

    def supersede(self) -> None:
        """A newer sync started in this process while this one was still running (its
        caller's cancellation never arrived): fail its waits and stop its inbox reader now,
        so that it cannot take, and drop, the newer sync's messages."""
        self.fail(TransferError(
            f"{self.engine.describe(self.placement)}: a newer sync started while this one "
            "was still running", stage="superseded",
        ))
        for task in [self._reader, *self._tasks]:
            task.cancel()

    async def close(self) -> None:
        """Stop the inbox reader and every background task of this session."""
        for task in [self._reader, *self._tasks]:
            task.cancel()
        await asyncio.gather(self._reader, *self._tasks, return_exceptions=True)

    # -- neighbours ----------------------------------------------------------------------
    async def downstream(self) -> Downstream:
        """The downstream neighbour, connected on its first ``hello``."""
        async with self._connecting:
            if self._downstream is None:
                placement, engine = self.placement, self.engine
                hello = await self.wait(
                    asyncio.shield(self._hello), timeout=engine.timeout,
                    on_timeout="waiting for its hello", peer=placement.downstream_name,
                )
                with engine.progress.waiting_on(placement.downstream_name, "connecting to it"):
                    peer = await run_blocking(engine.connect_peer, hello.peer)
                self._downstream = Downstream(peer, list(hello.slots), metadata=hello.peer)
        return self._downstream

    async def take_slot(self, index: int) -> tuple[Downstream, int]:
        """Wait until a downstream slot is free for bucket ``index``; claim it. If the slot
        got a new buffer, load the downstream's newest transport metadata first (alone on
        the connection: no other write uses it meanwhile)."""
        downstream = await self.downstream()
        slot = await self.wait(
            downstream.free.get(), timeout=self.engine.timeout,
            on_timeout=f"a free slot for bucket {index}", peer=self.placement.downstream_name,
        )
        if slot in downstream.unloaded:
            async with downstream.gate.renewing():
                if slot in downstream.unloaded:  # not already loaded by another forward
                    downstream.unloaded.clear()
                    with self.engine.progress.waiting_on(self.placement.downstream_name,
                                                         "reconnecting to it"):
                        downstream.peer = await run_blocking(
                            self.engine.connect_peer, downstream.metadata
                        )
        return downstream, slot

    async def send(self, endpoint: str, peer: str, message: RingMessage) -> None:
        """Send ``message`` to a neighbour."""
        await self.wait(
            self.engine.channel.send(endpoint, message, self.engine.timeout),
            timeout=self.engine.timeout + 1,
            on_timeout=f"sending {type(message).__name__.lower()}", peer=peer,
        )

    async def send_downstream(self, message: RingMessage) -> None:
        """Send ``message`` to the downstream neighbour, if there is one."""
        if self.placement.downstream is not None:
            await self.send(self.placement.downstream, self.placement.downstream_name, message)
