"""verl's rollout workers that take weightsync's staged syncs.

verl's ``CheckpointEngineWorker`` loads every update into its server as it arrives, so a
replica of them is paused for the whole transfer. :class:`StagingCheckpointEngineWorker` is
that worker with the calls of weightsync's two phases (``stage_weights``, ``commit_staged``,
``roll_back_commit``, ``discard_staged``, ``weights_status``): weightsync's manager
(``checkpoint_manager_class=weightsync_verl.CheckpointEngineManager``) then moves and
checks each update into a host stage while the replica keeps generating, pauses the replica
(verl's ``abort_all_requests``: its partial rollout keeps what was generated) only to load
the stage into the server, resumes it, and rolls a failed load back to the version it
served. What arrives goes through weightsync-core's rollout worker
(:class:`weightsync_core.CheckpointEngineWorker`), which owns the stage and the copies.

verl builds its replicas' workers itself (``RolloutReplica.get_ray_class_with_init_args``):
:func:`staging_replica_class` makes a replica class that builds these instead, and
:func:`use_staging_replicas` puts such classes in verl's ``RolloutReplicaRegistry`` in the
calling process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import ray
from verl.checkpoint_engine import CheckpointEngineWorker as VerlCheckpointEngineWorker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs
from verl.workers.rollout import RolloutReplica
from verl.workers.rollout.replica import RolloutReplicaRegistry

from weightsync_core import (
    CheckpointEngine,
    CheckpointEngineConfig,
    CheckpointEngineWorker,
    ServerAdapter,
)
from weightsync_core.spi import WeightSyncError
from weightsync_verl.engines import WeightsyncCheckpointEngine, weightsync_backend_name

__all__ = ["StagingCheckpointEngineWorker", "staging_replica_class", "use_staging_replicas"]

_ONE_TO_ALL = Dispatch["ONE_TO_ALL"]


class StagingCheckpointEngineWorker(VerlCheckpointEngineWorker):
    """verl's ``CheckpointEngineWorker`` that also stages: its engine and server adapter are
    verl's, built as verl builds them; what arrives, in a stop-the-world update as in a
    staged one, goes through weightsync's rollout worker (``self.rollout_worker``).

    Staging needs the engine to be a weightsync backend in verl (``weightsync_<name>``);
    with another (verl's own ``nccl``, ``nixl``) the staging calls refuse, naming it, and
    verl's ``update_weights`` works as before. A stop-the-world ``update_weights`` loads
    whatever arrives, as verl's worker does (no manifest check), and drops a stage.
    """

    def __init__(self, rollout_config: Any, model_config: Any, server_adapter: Any = None,
                 *args: Any, **kwargs: Any) -> None:
        super().__init__(rollout_config, model_config, server_adapter, *args, **kwargs)
        self._rollout_worker: CheckpointEngineWorker | None = None

    @property
    def rollout_worker(self) -> CheckpointEngineWorker:
        """weightsync's rollout worker over this worker's engine and server adapter (the
        engine as it is now: verl's worker may rebuild it).

        Raises:
            WeightSyncError: the engine is not a weightsync backend.
        """
        engine = self.checkpoint_engine
        if not isinstance(engine, WeightsyncCheckpointEngine):
            raise WeightSyncError(
                f"checkpoint_engine.backend={self.rollout_config.checkpoint_engine.backend!r} "
                f"({type(engine).__name__}) cannot stage: staged syncs need a weightsync "
                "backend in verl (weightsync_<name>, custom_backend_module=weightsync_verl)")
        adapter = _served_by(self.server_adapter)
        worker = self._rollout_worker
        if worker is None:
            config = self.rollout_config.checkpoint_engine
            worker = self._rollout_worker = CheckpointEngineWorker(
                CheckpointEngineConfig(
                    backend=weightsync_backend_name(config.backend),
                    update_weights_bucket_megabytes=config.update_weights_bucket_megabytes),
                adapter, engine=cast(CheckpointEngine, engine))
        else:
            worker.checkpoint_engine = cast(CheckpointEngine, engine)
            worker.server_adapter = adapter
        return worker

    @register(dispatch_mode=_ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None) -> None:
        """verl's stop-the-world update: load what arrives into the server (a stage, if
        any, is dropped: this version is newer)."""
        if not isinstance(self.checkpoint_engine, WeightsyncCheckpointEngine):
            # verl annotates global_steps as an int that defaults to None
            await super().update_weights(global_steps)  # pyright: ignore[reportArgumentType]
            return
        await self.rollout_worker.update_weights(global_steps, allow_manifest_change=True)

    async def stage_weights(self, global_steps: int | None = None,
                            allow_manifest_change: bool = False) -> dict[str, float]:
        """Phase 1: receive the update into a stage, checked whole, while the server serves
        (:meth:`weightsync_core.CheckpointEngineWorker.stage_weights`)."""
        return await self.rollout_worker.stage_weights(global_steps, allow_manifest_change)

    async def commit_staged(self) -> dict[str, float]:
        """Phase 2, under the replica's pause: load the stage into the server; a failed load
        is rolled back to the version it served
        (:meth:`weightsync_core.CheckpointEngineWorker.commit_staged`)."""
        return await self.rollout_worker.commit_staged()

    async def roll_back_commit(self) -> None:
        """Undo the last commit (another worker of the replica failed to take its stage)."""
        await self.rollout_worker.roll_back_commit()

    def forget_replaced(self) -> None:
        """Drop the copy of the version the last commit replaced (every worker of the
        replica took its stage)."""
        self.rollout_worker.forget_replaced()

    def discard_staged(self) -> None:
        """Drop the stage, if any (the server never saw it)."""
        self.rollout_worker.discard_staged()

    def weights_status(self) -> dict[str, Any]:
        """What the server serves, what is staged and what a failed commit rolls back to
        (:meth:`weightsync_core.CheckpointEngineWorker.weights_status`)."""
        return self.rollout_worker.weights_status()


def _served_by(adapter: Any) -> ServerAdapter:
    """verl's server adapter (a ``BaseRollout``) as the server weightsync's worker loads
    into: verl annotates the weights it takes as a generator, and its own worker passes the
    engine's async iterator, as weightsync's does."""
    return cast(ServerAdapter, adapter)


def staging_replica_class(replica_class: type[RolloutReplica]) -> type[RolloutReplica]:
    """``replica_class`` (a verl ``RolloutReplica``, e.g. ``vLLMReplica``) with
    :class:`StagingCheckpointEngineWorker` as its workers (built with the arguments
    ``replica_class`` gives verl's worker).

    Raises:
        TypeError: (when the replica builds its workers) ``replica_class`` builds workers of
            another class than verl's ``CheckpointEngineWorker``, which a staging worker
            would replace.
    """

    def get_ray_class_with_init_args(self: RolloutReplica) -> RayClassWithInitArgs:
        built = replica_class.get_ray_class_with_init_args(self)
        workers: Any = getattr(built.cls, "__ray_actor_class__", built.cls)
        if workers is not VerlCheckpointEngineWorker:
            raise TypeError(
                f"{replica_class.__name__} builds {getattr(workers, '__name__', workers)} "
                "workers, not verl's "
                "CheckpointEngineWorker: a staging replica would replace them; give it "
                "staging calls of its own instead")
        built.cls = ray.remote(StagingCheckpointEngineWorker)
        return built

    return type(f"Staging{replica_class.__name__}", (replica_class,), {
        "get_ray_class_with_init_args": get_ray_class_with_init_args,
        "__module__": __name__,
        "__doc__": f"verl's {replica_class.__name__} whose workers stage "
                   "(StagingCheckpointEngineWorker).",
    })


def use_staging_replicas(*names: str) -> None:
    """Make verl's ``RolloutReplicaRegistry`` in this process give, for each rollout name
    in ``names`` (``vllm``, ``sglang``; every registered one if none), the replica class
    it gave before with staging workers (:func:`staging_replica_class`). Call it in the
    process that builds the replicas, before it builds them."""
    registry = RolloutReplicaRegistry._registry  # verl's registry lists nothing
    for name in names or tuple(registry):
        loader = registry.get(name)
        if loader is None:
            raise ValueError(f"verl has no rollout replica named {name!r}; it has "
                             f"{sorted(registry)}")
        if loader in _STAGING_LOADERS:
            continue
        staged = functools.cache(lambda loader=loader: staging_replica_class(loader()))
        _STAGING_LOADERS.add(staged)
        RolloutReplicaRegistry.register(name, staged)


_STAGING_LOADERS: set[Callable[[], type[RolloutReplica]]] = set()
"""The registry entries :func:`use_staging_replicas` made (each builds its class once)."""
