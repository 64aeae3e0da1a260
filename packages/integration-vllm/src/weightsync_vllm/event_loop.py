"""A private asyncio loop on its own thread, for weightsync engines living in a process whose
caller is synchronous (a vLLM worker calls its weight-transfer engine from plain methods)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["EventLoopThread"]

T = TypeVar("T")


class EventLoopThread:
    """One event loop, run forever on a daemon thread: every call of one weightsync engine
    goes through :meth:`run`, so the engine's sockets and tasks stay on one loop."""

    def __init__(self, name: str = "weightsync-vllm") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, awaitable: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``awaitable`` on the loop and wait for its result (at most ``timeout``
        seconds: then it is cancelled and :class:`TimeoutError` raised)."""

        async def wrapped() -> T:
            return await asyncio.wait_for(awaitable, timeout)

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result()

    def close(self) -> None:
        """Stop the loop and its thread."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()
