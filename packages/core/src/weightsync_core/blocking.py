"""Running blocking transport calls without stalling the event loop.

Transport waits (a collective's ``wait()``, group set-up, group teardown) may block until a
peer answers or a timeout fires. They run on a dedicated, generously sized thread pool so
that waits left behind by a failed sync can never starve the next one, and the event loop
stays free to answer the manager (abort, finalize, status).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["retrieve_exception", "run_blocking"]

T = TypeVar("T")

_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="weightsync-blocking")


async def run_blocking(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Await ``function(*args, **kwargs)`` run on weightsync's blocking-call thread pool."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, functools.partial(function, *args, **kwargs))


def retrieve_exception(future: asyncio.Future) -> None:
    """Done-callback that marks a future's exception as seen, for futures whose failure is
    reported another way (or not worth reporting): no "exception was never retrieved"."""
    if not future.cancelled():
        future.exception()
