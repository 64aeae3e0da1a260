"""verl's worker actors (its actor workers and ``CheckpointEngineWorker``) as the worker
groups weightsync's manager drives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightsync_core import RayWorkerGroup

__all__ = ["VerlWorkerGroup", "role_prefix"]

_ENGINE_METHOD = "execute_checkpoint_engine"


def role_prefix(worker_group: Any) -> str:
    """The prefix of the names under which the actors of verl worker group
    ``worker_group`` expose its methods.

    verl's trainers build their actor group from a colocated worker class
    (``create_colocated_worker_cls``, then ``spawn``): its actors expose each role's methods
    as ``<role>_<method>`` (``actor_rollout_update_weights``), and the spawned group binds
    them back to the plain names. The prefix is ``"<role>_"`` for such a group and ``""``
    for a group of plain workers.

    Raises:
        TypeError: ``worker_group`` has no ``execute_checkpoint_engine`` (it is not the
            group of verl workers that own a checkpoint engine).
    """
    bound = getattr(worker_group, _ENGINE_METHOD, None)
    if bound is None:
        raise TypeError(
            f"{type(worker_group).__name__} has no {_ENGINE_METHOD}(): pass verl's actor "
            "worker group (ActorRolloutRefWorker's, or any worker with a checkpoint engine)"
        )
    suffix = f"_{_ENGINE_METHOD}"
    for name in dir(worker_group):
        if name.endswith(suffix) and getattr(worker_group, name) is bound:
            return name.removesuffix(_ENGINE_METHOD)
    return ""


class VerlWorkerGroup(RayWorkerGroup):
    """Ray handles of verl workers that own a checkpoint engine.

    Engine calls go straight to each worker's ``execute_checkpoint_engine`` (as verl's
    dispatch does, one call per rank), under the role prefix of a colocated group.
    ``update_weights`` uses verl's signature (``global_steps=``, plus ``mode=`` on the actor
    side), and each rank's result is what its engine moved: verl's workers return the
    engine's metrics or nothing, so the counts come from the engine's ``transfer_stats()``
    afterwards.

    Args:
        workers: the workers' Ray handles, in rank order.
        mode: verl's ``mode`` argument of the actor workers' ``update_weights`` (the verl
            backend name); ``None`` for rollout workers, which take none.
        method_prefix: the role prefix of the workers' method names (see
            :func:`role_prefix`).
    """

    def __init__(
        self, workers: Sequence[Any], mode: str | None = None, method_prefix: str = ""
    ) -> None:
        super().__init__(workers, method_prefix)
        self.mode = mode

    @classmethod
    def of_verl_group(cls, worker_group: Any, mode: str | None = None) -> VerlWorkerGroup:
        """The workers of verl worker group ``worker_group``, as verl's trainer built it
        (plain, or spawned from a colocated worker class)."""
        return cls(worker_group.workers, mode=mode, method_prefix=role_prefix(worker_group))

    def update_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        **delta: str | None,
    ) -> list[Any]:
        """Start each rank's side of the transfer; one awaitable per rank."""
        if allow_manifest_change:
            raise ValueError(
                "verl's workers load whatever arrives: they have no manifest check to relax, so "
                "update_weights(allow_manifest_change=True) does not apply to them"
            )
        _refuse_delta_plan(delta)
        return [self._transfer(worker, global_steps) for worker in self.workers]

    def stage_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        **delta: str | None,
    ) -> list[Any]:
        """Phase 1 of a staged sync on verl workers that stage
        (:class:`~weightsync_verl.staging.StagingCheckpointEngineWorker`)."""
        _refuse_delta_plan(delta)
        return [self.remote_method(worker, "stage_weights").remote(
                    global_steps, allow_manifest_change) for worker in self.workers]

    def verl_update_weights(self, global_steps: int | None = None) -> list[Any]:
        """verl's own ``update_weights(global_steps=, mode=)`` on every rank (what its naive
        hand-over runs); one Ray object ref per rank."""
        return [self._verl_update(worker, global_steps) for worker in self.workers]

    def _verl_update(self, worker: Any, global_steps: int | None) -> Any:
        options = {"mode": self.mode} if self.mode is not None else {}
        return self.remote_method(worker, "update_weights").remote(
            global_steps=global_steps, **options
        )

    async def _transfer(self, worker: Any, global_steps: int | None) -> Any:
        await self._verl_update(worker, global_steps)
        return await self.remote_method(worker, _ENGINE_METHOD).remote("transfer_stats")


def _refuse_delta_plan(delta: dict[str, str | None]) -> None:
    """verl's workers cannot take the manager's delta plan.

    Raises:
        ValueError: ``delta`` carries one.
    """
    if any(value is not None for value in delta.values()):
        raise ValueError(
            "verl's workers call their engines themselves: the manager's delta plan "
            "(CheckpointEngineConfig.delta) cannot reach them. Delta sync into verl's "
            "workers runs under verl's own manager: engine_kwargs "
            "{weightsync_<backend>: {delta: true}}"
        )
