"""A Ray deployment of ``actor_wg`` ranks and rollout replicas for one backend.

What the benchmarks (:mod:`weightsync_core.bench`) measure, and what the test harness
(:class:`weightsync_core.testing.SyncHarness`) builds its recording and fault injection on.
Its processes hold synthetic weights and drop what they receive: actor ranks with equal
float32 tensors (:class:`UniformWeightsSource`) and rollout workers whose server consumes
every tensor and keeps nothing (:class:`DiscardingRolloutWorker`).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from typing import Any, ClassVar, Protocol, runtime_checkable

import ray
import torch

from weightsync_core.api.config import CheckpointEngineConfig
from weightsync_core.api.plugins import load_custom_backend_module
from weightsync_core.api.registry import CheckpointEngineRegistry
from weightsync_core.data.shards import LayoutSpec, resolve_layout
from weightsync_core.orchestration.local_ray import ensure_ray
from weightsync_core.orchestration.manager import CheckpointEngineManager
from weightsync_core.orchestration.ray_group import RayRolloutReplica, RayWorkerGroup
from weightsync_core.worker import ActorCheckpointEngineMixin, CheckpointEngineWorker

__all__ = [
    "Deployment",
    "DiscardingRolloutWorker",
    "DiscardingServerAdapter",
    "Placement",
    "UniformWeightsSource",
    "WorkerPlacement",
]


class Placement(Protocol):
    """Where a deployment starts its processes (e.g. ``weightsync_testbed.HostPlacement``):
    extra ``ray.remote`` options per actor rank and per replica, merged over
    ``actor_options``."""

    def actor_options(self, rank: int) -> dict[str, Any]:
        """Options of actor rank ``rank``."""
        ...

    def replica_options(self, index: int) -> dict[str, Any]:
        """Options of every worker of the ``index``-th replica the deployment starts."""
        ...


@runtime_checkable
class WorkerPlacement(Placement, Protocol):
    """A :class:`Placement` that places each worker of a replica on its own (every process
    on a host of its own, as GPU hosts with a NIC per GPU are modelled)."""

    def worker_options(self, index: int, worker: int) -> dict[str, Any]:
        """Options of worker ``worker`` of the ``index``-th replica the deployment starts."""
        ...


class DiscardingServerAdapter:
    """A stand-in inference server that consumes every received tensor and keeps none.

    Attributes:
        layout: what it needs, for engines that deliver layouts (None: every tensor whole).
    """

    def __init__(self) -> None:
        self.layout: LayoutSpec | None = None

    def weight_layout(self) -> LayoutSpec | None:
        """What this server needs (:attr:`layout`)."""
        return self.layout

    async def update_weights(
        self, weights: AsyncIterator[tuple[str, torch.Tensor]], global_steps: int | None = None
    ) -> None:
        async for _ in weights:
            pass


class DiscardingRolloutWorker(CheckpointEngineWorker):
    """Rollout worker whose server adapter is a :class:`DiscardingServerAdapter`."""

    def __init__(self, config: CheckpointEngineConfig) -> None:
        self.discarding_adapter = DiscardingServerAdapter()
        super().__init__(config, self.discarding_adapter)

    def set_layout(self, layout: LayoutSpec | None) -> None:
        """Need only ``layout`` of every tensor from the next sync on (engines that deliver
        layouts; None: every tensor whole)."""
        self.discarding_adapter.layout = layout


class UniformWeightsSource(ActorCheckpointEngineMixin):
    """An ``actor_wg`` rank holding equal float32 tensors of random values (none until
    :meth:`set_uniform_weights`); a colocated engine hands them to a discarding server."""

    def __init__(self, config: CheckpointEngineConfig) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.layout: LayoutSpec | None = None
        self.init_checkpoint_engine(config, DiscardingServerAdapter())

    def set_layout(self, layout: LayoutSpec | None) -> None:
        """Hold only ``layout`` of every tensor (an FSDP rank's rows, say) for engines that
        deliver layouts; None: every tensor whole."""
        self.layout = layout

    def weight_layout(self) -> LayoutSpec | None:
        return self.layout

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in self.weights.items()}

    def iter_weight_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        shapes = {name: tuple(tensor.shape) for name, tensor in self.weights.items()}
        held = resolve_layout(self.layout, shapes, "this actor rank")
        return ((name, box.cut(self.weights[name])) for name, box in held.boxes.items())

    def set_uniform_weights(self, total_bytes: int, num_tensors: int,
                            columns: int | None = None) -> int:
        """Replace the weights by ``num_tensors`` equal float32 tensors of at most
        ``total_bytes`` in all (matrices of ``columns`` columns where given, as a linear
        layer's weights; else flat); returns their total size in bytes."""
        numel = total_bytes // num_tensors // 4
        shape = (numel,) if columns is None else (numel // columns, columns)
        self.weights = {f"layer.{i}.weight": torch.rand(shape) for i in range(num_tensors)}
        return math.prod(shape) * 4 * num_tensors

    def optimizer_step(self, learning_rate: float, seed: int) -> None:
        """Move every element by ``learning_rate`` up or down (the size of an Adam update,
        whose steps are about ``lr`` per element), as one training step moves fp32 master
        weights: a rollout cast of them (bf16) changes only where an element crosses a
        rounding boundary."""
        generator = torch.Generator().manual_seed(seed)
        for tensor in self.weights.values():
            signs = torch.randint(0, 2, tensor.shape, generator=generator, dtype=torch.int8)
            tensor.add_(signs.to(tensor.dtype).mul_(2).sub_(1), alpha=learning_rate)

    def change_elements(self, fraction: float, seed: int) -> None:
        """Give about ``fraction`` of every tensor's elements (drawn with ``seed``) new
        random values: the sparse change a delta sync benchmark moves."""
        generator = torch.Generator().manual_seed(seed)
        for tensor in self.weights.values():
            flat = tensor.view(-1)
            changed = round(fraction * flat.numel())
            positions = torch.randint(0, flat.numel(), (changed,), generator=generator)
            flat[positions] = torch.rand(changed, generator=generator)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.weights.items())


class Deployment:
    """``actor_world_size`` actor ranks and replicas of the given sizes, for one backend,
    started as Ray actors (on this machine, or where ``placement`` says).

    Subclasses choose the processes through :attr:`source_class` (an ``actor_wg`` rank:
    an :class:`~weightsync_core.worker.actor.ActorCheckpointEngineMixin` built from the config)
    and :attr:`worker_class` (a rollout worker built from the config).

    Args:
        config: checkpoint-engine config used by every process.
        actor_world_size: number of ``actor_wg`` ranks.
        replica_sizes: workers per rollout replica; ignored for colocated backends.
        actor_options: extra ``ray.remote`` options of every process, e.g. ``{"num_gpus": 1}``.
        placement: which host each actor rank and replica goes to (default: wherever Ray
            puts them).
    """

    source_class: ClassVar[type] = UniformWeightsSource
    worker_class: ClassVar[type] = DiscardingRolloutWorker

    def __init__(
        self,
        config: CheckpointEngineConfig,
        actor_world_size: int,
        replica_sizes: Sequence[int],
        actor_options: dict[str, Any] | None = None,
        placement: Placement | None = None,
    ) -> None:
        ensure_ray()
        self.actor_options = {"num_cpus": 0, **(actor_options or {})}
        self.placement = placement
        self.config = config
        load_custom_backend_module(config.custom_backend_module, config.trusted_modules)
        self.colocated = CheckpointEngineRegistry.get(config.backend).is_colocated
        self._source = ray.remote(self.source_class)
        self.actors = [self._new_actor(rank) for rank in range(actor_world_size)]
        self.actor_wg = RayWorkerGroup(self.actors)
        self._replicas_started = 0
        self.replicas: list[RayRolloutReplica] = []
        if not self.colocated:
            self.replicas = [self.new_replica(size, name=f"replica{i}")
                             for i, size in enumerate(replica_sizes)]

    def _new_actor(self, rank: int) -> Any:
        placed = self.placement.actor_options(rank) if self.placement else {}
        return self._source.options(**{**self.actor_options, **placed}).remote(self.config)

    def workers(self, replicas: Sequence[RayRolloutReplica] | None = None) -> list[Any]:
        """Every process of the deployment: actor ranks, then the rollout workers of
        ``replicas`` (default: all)."""
        chosen = self.replicas if replicas is None else replicas
        return [*self.actors, *(w for replica in chosen for w in replica.workers)]

    def new_replica(self, size: int, name: str | None = None) -> RayRolloutReplica:
        """Start a replica of ``size`` rollout workers (on one host, if placed; each on its
        own where the placement is a :class:`WorkerPlacement`)."""
        index, self._replicas_started = self._replicas_started, self._replicas_started + 1
        worker = ray.remote(self.worker_class)
        return RayRolloutReplica(
            [worker.options(**{**self.actor_options, **self._placed(index, rank)}).remote(
                self.config) for rank in range(size)], name=name)

    def _placed(self, index: int, worker: int) -> dict[str, Any]:
        """The placement's options of worker ``worker`` of the ``index``-th replica."""
        if self.placement is None:
            return {}
        if isinstance(self.placement, WorkerPlacement):
            return self.placement.worker_options(index, worker)
        return self.placement.replica_options(index)

    def manager(
        self, replicas: Sequence[RayRolloutReplica] | None = None, **config_overrides: Any
    ) -> CheckpointEngineManager:
        """A manager over ``replicas`` (default: all), with optional config overrides.

        The processes were built from :attr:`config`: overrides of what only the manager
        reads (``sync_timeout_seconds``, ``delta``, ``full_verify_every``) take effect, while
        one of a setting that changes what travels (``rollout_dtype``, ``verify``, the bucket
        size, the backend or its :data:`~weightsync_core.api.config.TRAVEL_OPTIONS`) makes its
        first sync fail at stage ``prepare``, before any byte moves, naming the setting."""
        config = replace(self.config, **config_overrides)
        chosen = self.replicas if replicas is None else replicas
        return CheckpointEngineManager(config, self.actor_wg, chosen)

    def shutdown(self) -> None:
        """Kill every actor rank and every worker of :attr:`replicas`."""
        for handle in [*self.actors, *(w for r in self.replicas for w in r.workers)]:
            ray.kill(handle)
