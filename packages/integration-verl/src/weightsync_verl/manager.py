"""weightsync's manager as verl's checkpoint manager
(``actor_rollout_ref.rollout.checkpoint_manager_class=weightsync_verl.CheckpointEngineManager``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from weightsync_core import CheckpointEngineConfig, awaitable_or_blocking
from weightsync_core import CheckpointEngineManager as WeightsyncManager
from weightsync_verl.engines import weightsync_backend_name
from weightsync_verl.groups import VerlWorkerGroup

__all__ = ["CheckpointEngineManager", "weightsync_config"]

_THIS_MODULE = "weightsync_verl"
_DEFAULT_TIMEOUT_SECONDS = CheckpointEngineConfig.sync_timeout_seconds


def weightsync_config(config: Any) -> CheckpointEngineConfig:
    """weightsync's configuration for verl's ``CheckpointEngineConfig`` ``config``.

    ``backend`` ``weightsync_X`` is weightsync backend ``X``; its ``engine_kwargs`` are the
    engine's options, except ``timeout`` (seconds: it bounds the whole sync), ``verify``,
    ``rollout_dtype`` and ``rollout_quantization``, which are settings of weightsync's
    config.
    ``custom_backend_module`` is imported by weightsync too, unless it is this package
    (which registers into verl's registry, not weightsync's).

    Raises:
        ValueError: ``backend`` is not a weightsync backend, or its ``engine_kwargs`` turn
            delta sync on (it runs under verl's own manager only).
    """
    backend = weightsync_backend_name(config.backend)
    options = dict((config.engine_kwargs or {}).get(config.backend) or {})
    delta = sorted({"delta", "full_verify_every"} & set(options))
    if delta:
        raise ValueError(
            f"engine_kwargs {config.backend}: {', '.join(delta)}: delta sync through verl's "
            "workers runs under verl's own checkpoint manager (way 1), which agrees each "
            "sync's plan in build_topology; weightsync's manager (way 2) cannot hand its plan "
            "to verl's workers. Drop them here, or keep verl's manager for delta sync"
        )
    module = config.custom_backend_module
    return CheckpointEngineConfig(
        backend=backend,
        update_weights_bucket_megabytes=config.update_weights_bucket_megabytes,
        sync_timeout_seconds=float(options.pop("timeout", _DEFAULT_TIMEOUT_SECONDS)),
        verify=options.pop("verify", True),
        rollout_dtype=options.pop("rollout_dtype", None),
        rollout_quantization=options.pop("rollout_quantization", None),
        engine_kwargs={backend: options},
        custom_backend_module=None if module == _THIS_MODULE else module,
    )


class CheckpointEngineManager(WeightsyncManager):
    """weightsync's manager with verl's constructor and call conventions.

    It drives verl's own actor worker group and rollout replicas: deadlines on every stage,
    blame naming the process and host, verified delivery, stale replicas after a failed
    sync, ``add_replicas`` / ``remove_replicas``. ``update_weights(global_steps)`` runs from
    synchronous code and is awaitable; every ``*_replicas`` method of verl's manager is here.
    With ``backend=naive`` the actor workers hand the weights over in-process, exactly as
    verl's manager does.

    Args:
        config: verl's checkpoint-engine config (``backend`` ``naive`` or ``weightsync_X``).
        actor_wg: verl's actor worker group.
        replicas: verl's rollout replicas.
    """

    def __init__(self, config: Any, actor_wg: Any, replicas: Iterable[Any] = ()) -> None:
        self.verl_config = config
        self.verl_actor_wg = actor_wg
        weightsync = (CheckpointEngineConfig(backend="naive") if config.backend == "naive"
                      else weightsync_config(config))
        self.actor_group = VerlWorkerGroup.of_verl_group(actor_wg, config.backend)
        super().__init__(weightsync, self.actor_group, replicas)

    def rollout_group(self, workers: list[Any]) -> VerlWorkerGroup:
        """verl's ``CheckpointEngineWorker`` actors of the replicas."""
        return VerlWorkerGroup(workers)

    @awaitable_or_blocking
    async def update_weights(
        self, global_steps: int | None = None, *, allow_manifest_change: bool = False
    ) -> dict[str, float]:
        """Move the actor's weights to every replica; returns weightsync's metrics (``{}``
        for ``naive``, as verl's manager)."""
        if self.verl_config.backend == "naive":
            await self._run_naive(global_steps)
            return {}
        return await super().update_weights(
            global_steps, allow_manifest_change=allow_manifest_change
        )

    async def _run_naive(self, global_steps: int | None) -> None:
        calls = [(f"actor_wg rank {rank}", ref)
                 for rank, ref in enumerate(self.actor_group.verl_update_weights(global_steps))]
        deadline = asyncio.get_running_loop().time() + self.config.sync_timeout_seconds
        await self.run_stage("transfer", calls, deadline)
