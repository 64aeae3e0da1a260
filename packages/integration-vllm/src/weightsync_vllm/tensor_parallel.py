"""A vLLM replica of several vLLM workers (``tensor_parallel_size`` > 1) behind one rollout
actor: each worker is one rank of a sync.

Every worker receives the full weights over the sync's backend (a broadcast group or a ring
of the workers, as for separate replicas) and loads them through vLLM's loaders, which keep
the worker's shard. The manager's calls reach a worker through its actor, which runs them on
all its workers at once (vLLM's ``collective_rpc``), each with its own rank's arguments.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from weightsync_core import RayRolloutReplica, split_per_rank

__all__ = [
    "StagedVLLMReplica",
    "VLLMReplica",
    "VLLMWorkerGroup",
    "VLLMWorkerRank",
    "cpu_threads_bind",
]


@dataclass(frozen=True)
class VLLMWorkerRank:
    """One vLLM worker of a rollout actor (a ``VLLMRolloutWorkerBase`` subclass), as a rank
    of a sync."""

    actor: Any
    """The rollout actor's Ray handle."""
    tensor_parallel_rank: int

    @property
    def weights_status(self) -> _RankStatus:
        """``weights_status.remote()``: what this vLLM worker serves, has staged and could
        roll back to (its actor's ``weights_status_of_rank``), as the manager asks a
        worker."""
        return _RankStatus(self.actor, self.tensor_parallel_rank)


@dataclass(frozen=True)
class _RankStatus:
    actor: Any
    rank: int

    def remote(self) -> Any:
        return self.actor.weights_status_of_rank.remote(self.rank)


class VLLMWorkerGroup:
    """The rollout side of a sync over :class:`VLLMWorkerRank` ranks (a
    :class:`~weightsync_core.api.protocols.CheckpointEngineWorkerGroup`): one call per actor
    serves all its ranks, and returns one Ray ``ObjectRef`` per rank.

    Args:
        workers: the ranks, each actor's consecutive and in tensor-parallel order.
    """

    def __init__(self, workers: Sequence[VLLMWorkerRank]) -> None:
        self.workers = list(workers)
        self._actors: list[tuple[Any, list[int]]] = []
        for actor, ranks in itertools.groupby(enumerate(self.workers), lambda w: w[1].actor):
            indices = [index for index, _ in ranks]
            if [self.workers[i].tensor_parallel_rank for i in indices] != list(range(len(indices))):
                raise ValueError(
                    "a rollout actor's vLLM workers must be consecutive ranks in tensor-parallel "
                    "order (build replicas with VLLMReplica)"
                )
            self._actors.append((actor, indices))

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def execute_checkpoint_engine(self, method: str, **per_rank_kwargs: list[Any]) -> list[Any]:
        kwargs = split_per_rank(method, per_rank_kwargs, self.world_size)
        refs: list[Any] = []
        for actor, indices in self._actors:
            refs += _refs(actor.execute_checkpoint_engine_per_rank.options(
                num_returns=len(indices)).remote(method, [kwargs[i] for i in indices]))
        return refs

    def update_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        **options: Any,
    ) -> list[Any]:
        """A sync's transfer on every rank (``options``: ``delta_base``, ``delta_version``;
        ``adapter`` for a LoRA adapter sync: the actors' ``update_weights_per_rank``)."""
        return self._per_rank("update_weights_per_rank", global_steps, allow_manifest_change,
                              **options)

    def stage_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        **delta: str | None,
    ) -> list[Any]:
        """Phase 1 of a staged sync on every rank (a :class:`StagedVLLMReplica`'s actor)."""
        return self._per_rank("stage_weights_per_rank", global_steps, allow_manifest_change,
                              **delta)

    def _per_rank(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """One call of the actors' ``method`` serving all their ranks; a ref per rank."""
        refs: list[Any] = []
        for actor, indices in self._actors:
            refs += _refs(getattr(actor, method).options(
                num_returns=len(indices)).remote(*args, **kwargs))
        return refs


class VLLMReplica(RayRolloutReplica):
    """A replica of one rollout actor whose vLLM engine runs ``tensor_parallel_size``
    workers, each a rank of a sync (any size, 1 included; one manager drives replicas of
    one kind). Lifecycle calls (pause, resume) go to the actor once.

    Args:
        actor: the rollout actor (a ``VLLMRolloutWorker`` or ``AsyncVLLMRolloutWorker``)
            started with ``engine_args={"tensor_parallel_size": tensor_parallel_size}``.
        tensor_parallel_size: its vLLM workers.
        name: the replica's name in errors.
    """

    worker_group_class = VLLMWorkerGroup

    def __init__(self, actor: Any, tensor_parallel_size: int = 1, name: str | None = None
                 ) -> None:
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        super().__init__([actor], name)
        self._ranks = [VLLMWorkerRank(actor, rank) for rank in range(tensor_parallel_size)]

    @property
    def workers(self) -> list[Any]:
        return list(self._ranks)


class StagedVLLMReplica(VLLMReplica):
    """A :class:`VLLMReplica` of a
    :class:`~weightsync_vllm.staged_worker.StagedAsyncVLLMRolloutWorker`, of any
    ``tensor_parallel_size``: weightsync-core's manager stages its syncs (every vLLM worker
    stages its copy while vLLM serves) and switches it as a whole (one pause of the engine,
    every worker's stage loaded, all rolled back where one fails).

    Args: as :class:`VLLMReplica`.
    """

    async def switch_to_staged(self, mode: str = "keep", timeout_seconds: float | None = None
                               ) -> dict[str, float]:
        """Phase 2 for the whole replica (its actor's ``switch_to_staged``)."""
        return await self._ranks[0].actor.switch_to_staged.remote(mode, timeout_seconds)

    async def discard_staged(self) -> None:
        """Drop every worker's stage."""
        await self._ranks[0].actor.discard_staged.remote()


def cpu_threads_bind(workers: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` splitting this process's CPUs between ``workers`` vLLM
    workers (vLLM binds its CPU workers one per NUMA node otherwise, and refuses with fewer
    nodes)."""
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // workers)
    return "|".join(",".join(map(str, cpus[i * share:(i + 1) * share]))
                    for i in range(workers))


def _refs(returned: Any) -> list[Any]:
    """The ``ObjectRef`` list of a call made with ``num_returns`` (one ref when it is 1)."""
    return list(returned) if isinstance(returned, list) else [returned]
