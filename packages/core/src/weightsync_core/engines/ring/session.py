"""One ring sync in one process: where the process sits in the ring (its
:class:`~weightsync_core.data.topology.RingPlacement`), what
the process lends the sync (:class:`RingLink`), the inbox reader that routes messages, bounded
waits that fail fast, and the connection to the downstream neighbour and the writes into its
slots."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from weightsync_core.api.engine import SyncProgress
from weightsync_core.api.errors import TransferError
from weightsync_core.api.passes import PassTimes
from weightsync_core.data.bucketing import BucketMeta
from weightsync_core.data.topology import RingPlacement
from weightsync_core.engines.ring.messages import (
    Abort,
    BucketReady,
    Credit,
    Final,
    Hello,
    RingMessage,
)
from weightsync_core.engines.ring.slots import Downstream, RegisteredSlots
from weightsync_core.net.blocking import run_blocking
from weightsync_core.net.channel import ControlChannel, PeerEndpoints
from weightsync_core.net.transport import PeerTransport, RemoteBuffer

__all__ = ["EARLY_MESSAGES", "RingLink", "RingSession"]

EARLY_MESSAGES = 64
"""Messages of another sync a session's inbox reader keeps for the session that opens next
in this process (see :attr:`RingLink.early`); older ones are dropped."""


@dataclass(frozen=True)
class RingLink:
    """What this process lends one ring sync (the engine builds it when the sync starts).

    Attributes:
        endpoints: the process's control channel (keyed with this sync's session key) and
            transport endpoint (one-sided writes, connections), reached through their owner:
            a finished sync must not keep a closed engine's transport alive (NIXL releases
            its agent, and the agent's listener, when the transport is dropped).
        slots: the process's registered bucket buffers.
        device: where the buckets live.
        timeout: the bound of every single wait, in seconds.
        progress: where waits are reported while they last.
        where: the process in error messages (``"NixlCheckpointEngine on rollout rank 1"``).
        early: messages of another sync that a session's reader took from the channel
            (kept by the engine across syncs). A session of an earlier sync whose caller's
            cancellation has not arrived yet still reads the channel, which already takes
            the next sync's key: what it reads of the next sync (a neighbour's ``hello``,
            sent before this process opened that sync's session) is kept here and handed
            to the next session when it opens, instead of being lost. Authentic messages
            only (sealed under the current key), at most :data:`EARLY_MESSAGES`.
        passes: where the sync's passes over its bytes are timed (the engine's).
    """

    endpoints: PeerEndpoints[PeerTransport, RingMessage]
    slots: RegisteredSlots
    device: torch.device
    timeout: float
    progress: SyncProgress
    where: str
    early: deque[RingMessage]
    passes: PassTimes

    @property
    def channel(self) -> ControlChannel[RingMessage]:
        """The process's control channel."""
        return self.endpoints.channel

    @property
    def transport(self) -> PeerTransport:
        """The process's transport endpoint."""
        return self.endpoints.transport


class RingSession:
    """One sync's traffic in this process: routes inbox messages to the main loop (from
    upstream) or to the slot credits (from downstream), writes buckets into the downstream
    neighbour's slots, and fails fast when any background task of the sync fails."""

    def __init__(self, link: RingLink, placement: RingPlacement) -> None:
        self.link = link
        self.placement = placement
        self.from_upstream: asyncio.Queue[BucketReady | Final | Abort] = asyncio.Queue()
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._hello: asyncio.Future[Hello] = asyncio.get_running_loop().create_future()
        self._downstream: Downstream | None = None
        self._connecting: asyncio.Lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        early = [message for message in link.early if message.sync == placement.sync_id]
        link.early.clear()  # what is not this sync's belongs to none that may still open
        for message in early:
            self._route(message)
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
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.fail(exc)

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
            with self.link.progress.waiting_on(peer, on_timeout):
                done, _ = await asyncio.wait(
                    {task, self.failed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
        except BaseException:
            task.cancel()
            raise
        if task in done:
            return task.result()
        task.cancel()
        if self.failed.done() and (failure := self.failed.exception()) is not None:
            raise failure
        raise TransferError(
            f"{self.link.where} waited {timeout:.0f}s for {peer} "
            f"({on_timeout}); is it alive? (sync_timeout_seconds bounds every wait)",
            peer=peer, stage=on_timeout,
        )

    async def _read_inbox(self) -> None:
        channel = self.link.channel
        try:
            while True:
                message: RingMessage = await channel.receive()
                if message.sync != self.placement.sync_id:
                    # an earlier, aborted sync's leftover, or the next sync's, which may
                    # open in this process later
                    self.link.early.append(message)
                    continue
                self._route(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a member broke the protocol: nothing else is in order
            self.fail(exc)

    def _route(self, message: RingMessage) -> None:
        """Hand a message of this sync to what waits for it."""
        if isinstance(message, BucketReady | Final | Abort):
            self.from_upstream.put_nowait(message)
        elif isinstance(message, Hello) and not self._hello.done():
            self._hello.set_result(message)
        elif isinstance(message, Credit) and self._downstream is not None:
            self._downstream.take_credit(message, self._downstream_name)

    def supersede(self) -> None:
        """A newer sync started in this process while this one was still running (its
        caller's cancellation never arrived): fail its waits and stop its inbox reader now,
        so that it cannot take, and drop, the newer sync's messages."""
        self.fail(TransferError(
            f"{self.link.where}: a newer sync started while this one "
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
                link = self.link
                hello = await self.wait(
                    asyncio.shield(self._hello), timeout=link.timeout,
                    on_timeout="waiting for its hello", peer=self._downstream_name,
                )
                with link.progress.waiting_on(self._downstream_name, "connecting to it"):
                    peer = await run_blocking(link.transport.connect, hello.peer)
                self._downstream = Downstream(peer, list(hello.slots))
        return self._downstream

    async def take_slot(self, index: int) -> tuple[Downstream, int]:
        """Wait until a downstream slot is free for bucket ``index``; claim it."""
        downstream = await self.downstream()
        slot = await self.wait(
            downstream.take(), timeout=self.link.timeout,
            on_timeout=f"a free slot for bucket {index}", peer=self._downstream_name,
        )
        return downstream, slot

    async def send(self, endpoint: str, peer: str, message: RingMessage) -> None:
        """Send ``message`` to a neighbour."""
        await self.wait(
            self.link.channel.send(endpoint, message, self.link.timeout),
            timeout=self.link.timeout + 1,
            on_timeout=f"sending {type(message).__name__.lower()}", peer=peer,
        )

    async def send_downstream(self, message: RingMessage) -> None:
        """Send ``message`` to the downstream neighbour, if there is one."""
        if self.placement.downstream is not None:
            await self.send(self.placement.downstream, self._downstream_name, message)

    @property
    def downstream_peer(self) -> Hashable | None:
        """The transport connection to the downstream neighbour (``None`` until connected)."""
        return None if self._downstream is None else self._downstream.peer

    @property
    def _downstream_name(self) -> str:
        return self.placement.downstream_name or "the downstream neighbour"

    # -- writing into the downstream neighbour -------------------------------------------
    async def forward_bucket(
        self, data: torch.Tensor, meta: BucketMeta, previous: asyncio.Task | None = None,
    ) -> None:
        """Write one bucket into a free downstream slot, then announce it (after the
        previous bucket's announcement, so they arrive in order)."""
        downstream, slot = await self.take_slot(meta.index)
        stage = f"writing bucket {meta.index}"
        target = downstream.slots[slot]
        if meta.nbytes > target.nbytes:
            raise TransferError(
                f"{self.link.where} has a {meta.nbytes}-byte bucket but "
                f"{self._downstream_name} has {target.nbytes}-byte slots; use the same "
                "update_weights_bucket_megabytes on both sides",
                peer=self._downstream_name, stage=stage,
            )
        await self._write(downstream.peer, data, target.at(0, meta.nbytes), stage)
        if previous is not None:
            await previous
        await self.send_downstream(BucketReady(self.placement.sync_id, slot, meta))

    async def _write(self, peer: Hashable, data: torch.Tensor, target: RemoteBuffer,
                     stage: str) -> None:
        """One bounded one-sided write to the downstream neighbour; failures name it."""
        name, timeout = self._downstream_name, self.link.timeout
        try:
            with self.link.passes.timed("write"):
                await self.wait(
                    run_blocking(self.link.transport.write, peer, data, target, timeout),
                    timeout=timeout + 5, on_timeout=stage, peer=name,
                )
        except TransferError as exc:
            if exc.peer:  # already names the peer (a timeout of this wait)
                raise
            raise TransferError(
                f"{self.link.where}: {stage} to {name} failed: {exc}",
                peer=name, stage=stage, code=exc.code,
            ) from exc
