"""``commit="each"``: a staged sync commits each replica as soon as every worker of it holds
a complete, checked stage, while the transfer to the others goes on; a replica whose stage
did not complete is not committed (its stage is discarded with the failed sync's)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import ray

from weightsync_core.api.protocols import RolloutReplica
from weightsync_core.orchestration.commit import ReplicaCommit
from weightsync_core.orchestration.stages import Calls

__all__ = ["CommitsAsStaged"]


class CommitsAsStaged:
    """Watches the rollout workers' stage calls of a staged sync and starts a replica's
    commit (``commit``) once all of its workers' calls have returned.

    Args:
        commit: starts the commit of one replica (pause, switch, resume; see
            :func:`~weightsync_core.orchestration.commit.commit_replica`).
    """

    def __init__(self, commit: Callable[[RolloutReplica], Awaitable[ReplicaCommit]]) -> None:
        self._commit = commit
        self._watchers: list[asyncio.Task[None]] = []
        self._commits: list[tuple[RolloutReplica, asyncio.Future[ReplicaCommit]]] = []
        self._closed = False

    def watching(self, calls: Callable[[], Calls], senders: int,
                 replicas: Sequence[RolloutReplica]) -> Callable[[], Calls]:
        """``calls`` (a transfer stage's: ``senders`` actor ranks' calls, then the workers'
        of ``replicas`` in order), each worker's call watched. The calls are handed on as
        they are where they can be awaited twice (Ray object refs, so that a failed stage
        still cancels them), else as tasks."""
        def watched() -> Calls:
            made = list(calls())
            shared = [(name, _awaitable_twice(call)) for name, call in made[senders:]]
            first = 0
            for replica in replicas:
                mine = [call for _, call in shared[first:first + len(replica.workers)]]
                first += len(replica.workers)
                self._watchers.append(asyncio.ensure_future(self._commit_when_staged(
                    replica, mine)))
            return [*made[:senders], *shared]
        return watched

    async def _commit_when_staged(self, replica: RolloutReplica,
                                  calls: list[Awaitable[Any]]) -> None:
        try:
            await asyncio.gather(*calls)
        except BaseException:  # its stage failed: the sync's error says how
            return
        if not self._closed:
            self._commits.append((replica, asyncio.ensure_future(self._commit(replica))))

    async def close(self, timeout_seconds: float) -> None:
        """Let the watchers of calls that have returned start their commits (for at most
        ``timeout_seconds``), then start no more: a stage still arriving after that is not
        committed."""
        if self._watchers:
            await asyncio.wait(self._watchers, timeout=timeout_seconds)
        self._closed = True
        for watcher in self._watchers:
            watcher.cancel()

    def committing(self, replica: RolloutReplica) -> bool:
        """Whether ``replica``'s commit was started."""
        return any(known is replica for known, _ in self._commits)

    async def outcomes(self) -> list[tuple[RolloutReplica, ReplicaCommit | BaseException]]:
        """Each started commit's replica and outcome (its error where pausing or resuming
        it failed), once all have ended."""
        results = await asyncio.gather(*(commit for _, commit in self._commits),
                                       return_exceptions=True)
        return [(replica, result) for (replica, _), result in zip(self._commits, results,
                                                                   strict=True)]


def _awaitable_twice(call: Awaitable[Any]) -> Awaitable[Any]:
    """``call`` where awaiting it again is safe (a Ray object ref), else a task of it."""
    if isinstance(call, ray.ObjectRef):
        return call
    return asyncio.ensure_future(call)
