"""Running blocking transport calls without stalling the event loop.

Transport waits (a collective's ``wait()``, group set-up, group teardown) may block until a
peer answers or a timeout fires. They run on a dedicated, generously sized thread pool so
that waits left behind by a failed sync can never starve the next one, and the event loop
stays free to answer the manager (abort, finalize, status).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["BlockingPool", "retrieve_exception", "run_blocking"]

T = TypeVar("T")


class BlockingPool:
    """Threads for blocking calls: started when a call finds none idle, up to
    ``max_workers``, and kept.

    A thread counts as idle *before* the caller learns that its call returned.
    :class:`concurrent.futures.ThreadPoolExecutor` counts it only after publishing the
    result, so an event loop that answers a result with the next call (the ring's
    ``connect`` and then its ``write``, every sync) often got there first, found no idle
    thread and started one more: strictly one-at-a-time calls grew the pool a thread every
    so often, towards ``max_workers`` (issue 23). Here the pool holds as many threads as
    calls were ever in flight at once.

    Threads are daemons; at interpreter exit the pool stops them after the calls they run
    have returned (as ``ThreadPoolExecutor`` does), from an :mod:`atexit` handler.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None
        ] = queue.SimpleQueue()
        self._idle = 0
        """Threads minus calls not yet returned (negative: calls wait for a thread)."""
        self._threads: list[threading.Thread] = []
        self._stopped = False
        os.register_at_fork(after_in_child=self._forget_threads)

    def _forget_threads(self) -> None:
        """In a forked child: the parent's threads are not there (start afresh)."""
        self._lock = threading.Lock()
        self._calls = queue.SimpleQueue()
        self._idle = 0
        self._threads = []

    @property
    def threads(self) -> int:
        """How many threads the pool has started."""
        return len(self._threads)

    def submit(self, function: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``function()`` on a pool thread; its future (cancelling it before a thread
        takes the call skips the call)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError("the blocking-call pool is shut down (interpreter exit)")
            if self._idle <= 0 and len(self._threads) < self.max_workers:
                thread = threading.Thread(
                    target=self._work, name=f"{self._prefix}_{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
                self._idle += 1
            self._idle -= 1
            self._calls.put((future, function))
        return future

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            future, function = call
            del call
            if not future.set_running_or_notify_cancel():
                with self._lock:
                    self._idle += 1
                continue
            try:
                result = function()
            except BaseException as exc:  # handed to the caller, as ThreadPoolExecutor does
                with self._lock:
                    self._idle += 1  # idle before the caller hears of it
                future.set_exception(exc)
                del exc
            else:
                with self._lock:
                    self._idle += 1  # idle before the caller hears of it
                future.set_result(result)
                del result
            del future, function

    def shutdown(self) -> None:
        """Stop every thread once the calls already submitted have returned (idempotent)."""
        with self._lock:
            self._stopped = True
            threads = list(self._threads)
        for _ in threads:
            self._calls.put(None)
        for thread in threads:
            thread.join()


_POOL = BlockingPool(max_workers=64, thread_name_prefix="weightsync-blocking")
atexit.register(_POOL.shutdown)


async def run_blocking(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Await ``function(*args, **kwargs)`` run on weightsync's blocking-call thread pool."""
    loop = asyncio.get_running_loop()
    return await asyncio.wrap_future(
        _POOL.submit(functools.partial(function, *args, **kwargs)), loop=loop
    )


def retrieve_exception(future: asyncio.Future) -> None:
    """Done-callback that marks a future's exception as seen, for futures whose failure is
    reported another way (or not worth reporting): no "exception was never retrieved"."""
    if not future.cancelled():
        future.exception()
