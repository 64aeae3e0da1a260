"""Minimal Ray implementations of the worker-group and replica protocols."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

__all__ = ["RayRolloutReplica", "RayWorkerGroup", "split_per_rank"]


def split_per_rank(method: str, per_rank_kwargs: dict[str, list[Any]], world_size: int
                   ) -> list[dict[str, Any]]:
    """The keyword arguments of each of ``world_size`` ranks (``kwargs_i[k] = v[i]``), as a
    worker group's ``execute_checkpoint_engine`` gets them.

    Raises:
        ValueError: an argument has another number of values, naming it and ``method``.
    """
    for key, values in per_rank_kwargs.items():
        if len(values) != world_size:
            raise ValueError(
                f"argument {key!r} of {method} has {len(values)} values for {world_size} ranks"
            )
    return [{key: values[rank] for key, values in per_rank_kwargs.items()}
            for rank in range(world_size)]


class RayWorkerGroup:
    """A list of Ray actor handles whose actors expose ``execute_checkpoint_engine`` and
    ``update_weights`` (e.g. :class:`~weightsync_core.worker.rollout.CheckpointEngineWorker`).

    Args:
        workers: the actors' handles, in rank order.
        method_prefix: prepended to every method name called on the actors, for actors
            that expose a role's methods under prefixed names (verl's colocated workers
            expose ``actor_rollout_update_weights``: prefix ``"actor_rollout_"``).
    """

    def __init__(self, workers: Sequence[Any], method_prefix: str = "") -> None:
        self.workers = list(workers)
        self.method_prefix = method_prefix

    def remote_method(self, worker: Any, name: str) -> Any:
        """``worker``'s remote method ``name`` (with :attr:`method_prefix`)."""
        return getattr(worker, f"{self.method_prefix}{name}")

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def execute_checkpoint_engine(self, method: str, **per_rank_kwargs: list[Any]) -> list[Any]:
        kwargs = split_per_rank(method, per_rank_kwargs, self.world_size)
        return [
            self.remote_method(worker, "execute_checkpoint_engine").remote(method, **kwargs[rank])
            for rank, worker in enumerate(self.workers)
        ]

    def update_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        **delta: str | None,
    ) -> list[Any]:
        return [self.remote_method(worker, "update_weights").remote(
                    global_steps, allow_manifest_change, **delta) for worker in self.workers]

    def stage_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        **delta: str | None,
    ) -> list[Any]:
        """Rollout workers only: phase 1 of a staged sync, into each worker's stage."""
        return [self.remote_method(worker, "stage_weights").remote(
                    global_steps, allow_manifest_change, **delta) for worker in self.workers]

    def update_weights_from_cache(self, global_steps: int | None = None) -> list[Any]:
        """Rollout workers only: load the actor side's cached weights (kimi)."""
        return [self.remote_method(worker, "update_weights_from_cache").remote(global_steps)
                for worker in self.workers]


class RayRolloutReplica:
    """A replica made of Ray ``CheckpointEngineWorker`` actors; lifecycle calls go to each."""

    def __init__(self, workers: Sequence[Any], name: str | None = None) -> None:
        self._workers = list(workers)
        self.name = name or f"replica-{id(self):x}"

    @property
    def workers(self) -> list[Any]:
        return self._workers

    async def _call_all(self, method: str, **options: Any) -> None:
        await asyncio.gather(*(getattr(worker, method).remote(**options)
                               for worker in self._workers))

    async def abort_all_requests(self) -> None:
        await self._call_all("abort_all_requests")

    async def pause_generation(self, mode: str = "keep") -> None:
        """Pause every worker's server for a switch of weights (``mode``: see
        :meth:`CheckpointEngineWorker.pause_generation
        <weightsync_core.worker.rollout.CheckpointEngineWorker.pause_generation>`)."""
        await self._call_all("pause_generation", mode=mode)

    async def release_kv_cache(self) -> None:
        await self._call_all("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        await self._call_all("resume_kv_cache")

    async def resume_generation(self) -> None:
        await self._call_all("resume_generation")

    async def sleep(self) -> None:
        await self._call_all("sleep")

    async def wake_up(self) -> None:
        await self._call_all("wake_up")

    def __repr__(self) -> str:
        return f"RayRolloutReplica({self.name!r}, workers={len(self._workers)})"
