"""The actor rank: the policy, sharded with FSDP2, and the sending side of weight sync."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import PretrainedConfig

from weightsync_core import (
    ActorCheckpointEngineMixin,
    AdapterSpec,
    CheckpointEngineRegistry,
    WeightsSource,
)
from weightsync_core.data.shards import (
    LayoutSpec,
    fsdp_first_expert,
    fsdp_spec,
    fused_experts,
    per_expert_shapes,
    per_expert_stream,
)
from weightsync_trainer.algorithms import importance_weights, policy_loss
from weightsync_trainer.checksum import weights_digest
from weightsync_trainer.lora import (
    ADAPTER_NAME,
    adapter_parameters,
    adapter_spec,
    base_parameters,
    lora_config,
    with_adapter,
)
from weightsync_trainer.modeling import build_policy_model, response_log_probs
from weightsync_trainer.workers.generation import HFGenerationServer
from weightsync_trainer.workers.training import (
    TrainingWorker,
    full_parameters,
    local_parameters,
)

__all__ = ["ActorWorker"]


class ActorWorker(TrainingWorker, ActorCheckpointEngineMixin):
    """One ``actor_wg`` rank: trains the policy and sends its weights through its engine.

    Weights leave as full tensors gathered in groups of at most 64 MiB
    (:func:`full_parameters`), never as a gathered state dict. With a colocated backend
    (``naive``) the rank also serves generation from an in-process
    :class:`HFGenerationServer`, which receives the weights directly.

    With ``model.lora_rank`` > 0 the policy is a PEFT LoRA adapter on a frozen base: the
    weights syncs send are the base's (under its checkpoint names), the adapter goes in
    adapter syncs (:meth:`adapter_spec`, :meth:`iter_adapter_weights`).
    """

    role = "actor"
    model_type = "causal_lm"

    def build_model(self) -> torch.nn.Module:
        return with_adapter(build_policy_model(self.config.model), self.config.model)

    def init_model(self, master_addr: str, master_port: int) -> None:
        """Build the sharded policy, then this rank's checkpoint engine."""
        super().init_model(master_addr, master_port)
        engine_config = self.config.checkpoint_engine
        colocated = None
        if CheckpointEngineRegistry.get(engine_config.backend).is_colocated:
            colocated = HFGenerationServer(self.config.model, self.config.temperature,
                                           engine_config.rollout_torch_dtype)
        # every rank gathers the same full tensors: a delta sync spreads its copy over them
        self.init_checkpoint_engine(engine_config, server_adapter=colocated,
                                    delta_group=dist.group.WORLD)

    def iter_weights(self) -> WeightsSource:
        """Every parameter, gathered whole (in groups of at most 64 MiB), under its
        checkpoint name (fused experts one expert at a time; of a LoRA policy, the base's)."""
        return per_expert_stream(base_parameters(full_parameters(self._built_model())))

    def adapter_spec(self, name: str) -> AdapterSpec:
        """The LoRA adapter this rank trains (``model.lora_rank`` > 0), as syncs describe it.

        Raises:
            KeyError: ``name`` is not its adapter's name, or it trains no adapter.
        """
        model = self.config.model
        if not model.lora_rank or name != ADAPTER_NAME:
            raise KeyError(f"this actor trains no adapter {name!r}"
                           + (f" (its adapter is {ADAPTER_NAME!r})" if model.lora_rank else
                              " (actor_rollout_ref.model.lora_rank is 0)"))
        return adapter_spec(model)

    def iter_adapter_weights(self, name: str) -> WeightsSource:
        """The adapter's ``lora_A``/``lora_B`` parameters, gathered whole, under PEFT's
        state-dict names."""
        self.adapter_spec(name)
        return self._adapter_weights(self._built_model())

    @staticmethod
    def _adapter_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapter's tensors of ``model``, whole, under PEFT's state-dict names
        (collective: every rank in step)."""
        return adapter_parameters(full_parameters(model, trainable_only=True))

    def adapter_checksum(self) -> str:
        """Digest of the adapter's tensors (collective: call on every rank), as a replica's
        ``adapter_checksum`` of the version it holds takes it."""
        self.adapter_spec(ADAPTER_NAME)
        return weights_digest(self._adapter_weights(self._built_model()))

    def weights_checksum(self) -> str:
        """Digest of the full weights (collective: call on every rank); of a LoRA policy,
        of its base (as the rollout's is: compare them)."""
        return weights_digest(base_parameters(full_parameters(self._built_model())))

    def _fused_experts(self) -> int | None:
        """The experts of the model's fused expert tensors (None: it has none)."""
        return fused_experts({name: tuple(param.shape)
                              for name, param in self._built_model().named_parameters()})

    def weight_layout(self) -> LayoutSpec:
        """This rank's FSDP2 rows of every parameter (for backends that deliver layouts);
        of fused experts, whole experts (``Shard(0)`` over experts), streamed per expert."""
        return fsdp_spec(dist.get_world_size(), dist.get_rank(),
                         fused_experts=self._fused_experts() is not None)

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor's full shape and dtype under its checkpoint name, in stream order
        (of a LoRA policy, the base's)."""
        return per_expert_shapes({name: (tuple(param.shape), param.dtype) for name, param in
                                  base_parameters(self._built_model().named_parameters())})

    def iter_weight_shards(self) -> WeightsSource:
        """This rank's own rows of each parameter, gathered from no one, under its
        checkpoint name (of a LoRA policy, the base's); of fused experts, its whole experts
        one at a time, as views (no fused tensor is materialised)."""
        first = fsdp_first_expert(self._fused_experts() or 0, dist.get_world_size(),
                                  dist.get_rank())
        return per_expert_stream(base_parameters(local_parameters(self._built_model())), first)

    def update_policy(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Clipped policy-gradient update on this rank's shard (``input_ids``: prompt +
        response, ``advantages``: ``[batch, response_length]``). With
        ``behaviour_log_probs`` (each response token's log-probability under the weights
        that sampled it: asynchronous RL), decoupled PPO: the clip is against this actor
        before the update, and each token is weighted by
        :func:`~weightsync_trainer.algorithms.importance_weights`."""
        input_ids, advantages = batch["input_ids"], batch["advantages"]
        length = advantages.shape[1]
        temperature = self.config.temperature
        model = self._built_model()
        model.eval()
        with torch.no_grad():
            old_log_probs, _ = response_log_probs(model, input_ids, length, temperature)
        behaviour = batch.get("behaviour_log_probs")
        weights = (None if behaviour is None else
                   importance_weights(old_log_probs, behaviour, self.config.is_threshold))

        def loss_fn(rows: slice):
            log_probs, entropy = response_log_probs(model, input_ids[rows], length, temperature)
            loss, clip_fraction = policy_loss(
                log_probs, old_log_probs[rows], advantages[rows], self.config.clip_ratio,
                None if weights is None else weights[rows],
            )
            metrics = {
                "actor/pg_loss": loss.detach(),
                "actor/clip_fraction": clip_fraction,
                "actor/entropy": entropy.detach().mean(),
            }
            if weights is not None:
                metrics["actor/is_weight_mean"] = weights[rows].mean()
                metrics["actor/is_weight_max"] = weights[rows].max()
            return loss, metrics

        return self._optimize(loss_fn, input_ids.shape[0])

    async def generate(
        self, prompt_ids: torch.Tensor, response_length: int, seed: int,
        adapter: tuple[str, int] | None = None,
    ) -> torch.Tensor:
        """Colocated mode: sample from this rank's in-process rollout server (``adapter``:
        a LoRA adapter version it holds)."""
        return await self._colocated_server().generate(prompt_ids, response_length, seed,
                                                       adapter)

    async def abort_all_requests(self) -> None:
        """Colocated mode: pause the in-process rollout server for a weight sync."""
        await self._colocated_server().abort_all_requests()

    async def resume_generation(self) -> None:
        """Colocated mode: resume the in-process rollout server."""
        await self._colocated_server().resume_generation()

    async def release_kv_cache(self) -> None:
        """Colocated mode: nothing to free (``generate`` allocates its cache per call)."""

    def served_adapter_checksum(self, name: str, version: int) -> str:
        """Colocated mode: digest of ``version`` of LoRA adapter ``name`` as the in-process
        server serves it (compare with :meth:`adapter_checksum`)."""
        return weights_digest(self._colocated_server().adapters.tensors(name, version).items())

    def rollout_weights_checksum(self) -> str:
        """Colocated mode: digest of the weights the in-process server generates with."""
        return self._colocated_server().weights_checksum()

    def save_weights(self, directory: str) -> str | None:
        """Write ``model.safetensors`` and ``config.json`` (loadable with
        ``from_pretrained``) into ``directory``; of a LoRA policy, its base there and its
        adapter in ``directory/adapter`` as PEFT saves one (``adapter_model.safetensors``,
        ``adapter_config.json``: ``PeftModel.from_pretrained``). Collective: every rank gathers
        each tensor in turn, rank 0 keeps them and writes; returns the file path on rank 0."""
        model = self._built_model()
        tensors = {
            name: tensor.contiguous().clone()
            for name, tensor in base_parameters(full_parameters(model))
            if self.rank == 0
        }
        lora = self.config.model.lora_rank > 0
        adapter = ({name: tensor.contiguous().clone() for name, tensor in
                    self._adapter_weights(model)} if lora else {})
        if self.rank != 0:
            return None
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        if lora:  # in a folder of its own: transformers loads an adapter found beside
            (path / "adapter").mkdir(exist_ok=True)
            save_file(adapter, str(path / "adapter" / "adapter_model.safetensors"),
                      metadata={"format": "pt"})
            lora_config(self.config.model).save_pretrained(str(path / "adapter"))
        config = getattr(model, "config", None)
        if not isinstance(config, PretrainedConfig):
            raise TypeError(
                f"save_weights writes a Hugging Face model; {type(model).__name__} has no "
                "PretrainedConfig in .config"
            )
        config.to_json_file(str(path / "config.json"))
        return str(path / "model.safetensors")

    def worker_info(self) -> dict[str, Any]:
        engine = type(self.checkpoint_engine)
        return {**super().worker_info(),
                "engine_class": f"{engine.__module__}.{engine.__qualname__}"}

    def _colocated_server(self) -> HFGenerationServer:
        server = self.colocated_server_adapter
        if server is None:
            raise RuntimeError(
                "this actor rank serves no rollout: generation runs in the actor process only "
                "with a colocated backend "
                "(actor_rollout_ref.rollout.checkpoint_engine.backend=naive)"
            )
        if not isinstance(server, HFGenerationServer):
            raise TypeError(
                f"{type(self).__name__} generates through an HFGenerationServer, but its "
                f"colocated server adapter is a {type(server).__name__}"
            )
        return server
