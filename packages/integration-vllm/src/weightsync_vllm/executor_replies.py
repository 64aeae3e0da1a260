"""Every vLLM worker's reply to a failed call is read before the call raises.

vLLM 0.32's multiprocess executor (``MultiprocExecutor``, the one a ``tensor_parallel_size``
> 1 engine uses) reads its workers' replies to a ``collective_rpc`` in rank order and raises at
the first failed one, leaving the later workers' replies queued (vllm-project/vllm#49972,
open). Each of those answers the next call in place of its own, for good: after one weight
update that failed on every worker, every later update of the engine fails (or, worse, a
worker's failure is hidden behind its earlier success). weightsync fails a sync on every
worker at once (a sender's abort, a refused tensor), so a tensor-parallel replica would never
recover.

:func:`install` (run by the plugin in every vLLM process) wraps the executor's
``collective_rpc``: for an engine whose weight transfer is weightsync's, a call that every
worker answers and that fails has the replies it did not read read (within the call's
timeout) and dropped, so that the next call gets its own.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

__all__ = ["install"]

logger = logging.getLogger(__name__)

_MARK = "_weightsync_reads_every_reply"


class _CountedReplies:
    """A worker's reply queue that counts the replies taken from it."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self.reads = 0

    def dequeue(self, *args: Any, **kwargs: Any) -> Any:
        self.reads += 1
        return self.queue.dequeue(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


def _transfers_with(executor: Any, backend: str) -> bool:
    config = getattr(executor.vllm_config, "weight_transfer_config", None)
    return config is not None and config.backend == backend


def _read_the_rest(queues: list[_CountedReplies], deadline: float | None, method: Any) -> None:
    """Take and drop the reply of every worker whose reply the failed call did not read."""
    for rank, queue in enumerate(queues):
        if queue.reads:
            continue
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            status, _ = queue.queue.dequeue(timeout=left)
        except (TimeoutError, RuntimeError) as error:  # no reply in time, or shut down
            logger.warning("vLLM worker %d gave no reply to the failed call %s: %r", rank,
                           method, error)
            return
        logger.info("dropped vLLM worker %d's reply (%s) to the failed call %s", rank, status,
                    method)


def install(backend: str) -> None:
    """Make vLLM's multiprocess executor read every worker's reply to a failed call of an
    engine whose weight-transfer backend is ``backend`` (weightsync's; once per process;
    nothing where that executor does not exist)."""
    try:
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    except ImportError:
        return
    original = MultiprocExecutor.collective_rpc
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                       non_block: bool = False, unique_reply_rank: int | None = None,
                       **aggregators: Any) -> Any:
        if non_block or unique_reply_rank is not None or aggregators \
                or not _transfers_with(self, backend):
            return original(self, method, timeout, args, kwargs, non_block,
                            unique_reply_rank, **aggregators)
        replies = self.response_mqs
        queues = [_CountedReplies(queue) for queue in replies]
        deadline = None if timeout is None else time.monotonic() + timeout
        self.response_mqs = queues
        try:
            return original(self, method, timeout, args, kwargs)
        except RuntimeError:
            if any(queue.reads for queue in queues):  # the workers ran it
                _read_the_rest(queues, deadline, method)
            raise
        finally:
            self.response_mqs = replies

    setattr(collective_rpc, _MARK, True)
    MultiprocExecutor.collective_rpc = collective_rpc  # type: ignore[method-assign]
