"""A vLLM replica of several vLLM workers (``tensor_parallel_size`` > 1) behind one rollout
actor: each worker is one rank of a sync.

Every worker receives the full weights over the sync's backend (a broadcast group or a ring
of the workers, as for separate replicas) and loads them through vLLM's loaders, which keep
the worker's shard. The manager's calls reach a worker through its actor, which runs them on
all its workers at once (vLLM's ``collective_rpc``), each with its own rank's arguments.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from weightsync_core import RayRolloutReplica, split_per_rank

__all__ = ["VLLMReplica", "VLLMWorkerGroup", "VLLMWorkerRank"]


@dataclass(frozen=True)
class VLLMWorkerRank:
    """One vLLM worker of a rollout actor (a ``VLLMRolloutWorkerBase`` subclass), as a rank
    of a sync."""

    actor: Any
    """The rollout actor's Ray handle."""
    tensor_parallel_rank: int


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
        **delta: str | None,
    ) -> list[Any]:
        refs: list[Any] = []
        for actor, indices in self._actors:
            refs += _refs(actor.update_weights_per_rank.options(
                num_returns=len(indices)).remote(global_steps, allow_manifest_change, **delta))
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


def _refs(returned: Any) -> list[Any]:
    """The ``ObjectRef`` list of a call made with ``num_returns`` (one ref when it is 1)."""
    return list(returned) if isinstance(returned, list) else [returned]
