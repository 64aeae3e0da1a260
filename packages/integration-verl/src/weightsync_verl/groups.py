"""verl's worker actors (its actor workers and ``CheckpointEngineWorker``) as the worker
groups weightsync's manager drives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightsync_core import RayWorkerGroup

__all__ = ["VerlWorkerGroup"]


class VerlWorkerGroup(RayWorkerGroup):
    """Ray handles of verl workers that own a checkpoint engine.

    Engine calls go straight to each worker's ``execute_checkpoint_engine`` (as verl's
    dispatch does, one call per rank). ``update_weights`` uses verl's signature
    (``global_steps=``, plus ``mode=`` on the actor side), and each rank's result is what its
    engine moved: verl's workers return the engine's metrics or nothing, so the counts come
    from the engine's ``transfer_stats()`` afterwards.

    Args:
        workers: the workers' Ray handles, in rank order.
        mode: verl's ``mode`` argument of the actor workers' ``update_weights`` (the verl
            backend name); ``None`` for rollout workers, which take none.
    """

    def __init__(self, workers: Sequence[Any], mode: str | None = None) -> None:
        super().__init__(workers)
        self.mode = mode

    def update_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False
    ) -> list[Any]:
        """Start each rank's side of the transfer; one awaitable per rank."""
        if allow_manifest_change:
            raise ValueError(
                "verl's workers load whatever arrives: they have no manifest check to relax, so "
                "update_weights(allow_manifest_change=True) does not apply to them"
            )
        options = {"mode": self.mode} if self.mode is not None else {}
        return [self._transfer(worker, global_steps, options) for worker in self.workers]

    @staticmethod
    async def _transfer(worker: Any, global_steps: int | None, options: dict[str, Any]):
        await worker.update_weights.remote(global_steps=global_steps, **options)
        return await worker.execute_checkpoint_engine.remote("transfer_stats")
