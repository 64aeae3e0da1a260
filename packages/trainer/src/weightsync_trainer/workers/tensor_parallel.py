"""A synthetic tensor-parallel rollout worker: it receives only its tensor-parallel slices of
a Qwen2/Llama model (as vLLM splits it) from a sharded backend, and assembles the whole
model from its peers' slices before it serves or reports a checksum. Generation itself is
not split: the replica's first worker generates once its model is whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import torch

from weightsync_core.data.quantization import (
    Offsets,
    covered_blocks,
    dequantized,
    dequantized_stream,
    quantized_weight_of,
)
from weightsync_core.data.shards import (
    DecoderShape,
    Layout,
    LayoutSpec,
    MoEShape,
    moe_spec,
    resolve_layout,
    tensor_parallel_spec,
)
from weightsync_core.data.shards.quantized import scale_box
from weightsync_trainer.config import MOE_MODEL_TYPES, ModelConfig
from weightsync_trainer.errors import ConfigError
from weightsync_trainer.workers.generation import HFGenerationServer

__all__ = ["TENSOR_PARALLEL_MODEL_TYPES", "TensorParallelGenerationServer"]

TENSOR_PARALLEL_MODEL_TYPES = frozenset({"llama", "qwen2"}) | MOE_MODEL_TYPES
"""Model types whose tensor-parallel split core's ``decoder_tensor_parallel_layout`` (or,
for mixtures of experts, ``moe_layout``: every expert split) follows."""

Slices = dict[str, tuple[list[list[int]], torch.Tensor]]
"""Tensor name -> (its box's ranges, the piece) of one worker."""


class TensorParallelGenerationServer(HFGenerationServer):
    """Rank ``tp_rank`` of ``tp_size`` workers that split one replica's model.

    It declares its slices as its ``weight_layout`` (sharded backends deliver only those);
    other backends deliver whole tensors, of which it keeps its slices
    (``takes_whole_weights``). Weights quantized on send (``fp8_block``) arrive as float8
    slices with the scales of the blocks they touch (or whole, with every scale), and are
    dequantized slice by slice. Its model holds its own slices, fresh after every sync, and
    is made whole from its peers' slices (:meth:`set_peers`) when it next generates or
    reports its checksum; a peer on another weights version is refused, naming it.

    Raises:
        ConfigError: a model type whose split is not known, or a model that does not
            divide over ``tp_size`` workers.
    """

    takes_whole_weights = True

    def __init__(self, model: ModelConfig, temperature: float, dtype: torch.dtype | None,
                 tp_size: int, tp_rank: int) -> None:
        super().__init__(model, temperature, dtype)
        hf_config = self.model.config
        if hf_config.model_type not in TENSOR_PARALLEL_MODEL_TYPES:
            raise ConfigError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp_size} needs a model "
                f"of type {' or '.join(sorted(TENSOR_PARALLEL_MODEL_TYPES))}, got "
                f"{hf_config.model_type!r}")
        try:
            self.layout_spec: LayoutSpec = (
                moe_spec(MoEShape.from_hf_config(hf_config), tp_size, tp_rank)
                if hf_config.model_type in MOE_MODEL_TYPES else
                tensor_parallel_spec(DecoderShape.from_hf_config(hf_config), tp_size, tp_rank))
            shapes = {name: tuple(tensor.shape)
                      for name, tensor in self.checkpoint_tensors().items()}
            self.layout: Layout = resolve_layout(self.layout_spec, shapes,
                                                 f"tensor-parallel rank {tp_rank}")
        except ValueError as exc:
            raise ConfigError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp_size}: {exc}") from None
        self.tp_rank = tp_rank
        self.offsets: Offsets = {name: (box.ranges[0][0], box.ranges[1][0])
                                 for name, box in self.layout.boxes.items()
                                 if len(box.ranges) == 2}
        """Where each 2-D slice lies in its whole weight (a float8 slice's blocks)."""
        self.peers: Sequence[Any] = ()
        self._whole_version: int | None = None
        self._assembling = asyncio.Lock()

    def set_peers(self, peers: Sequence[Any]) -> None:
        """The other workers of this replica (Ray handles with ``tensor_parallel_slices``)."""
        self.peers = list(peers)

    def weight_layout(self) -> LayoutSpec:
        """This worker's tensor-parallel slices."""
        return self.layout_spec

    def _own_slice(self, name: str, tensor: torch.Tensor,
                   params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This worker's slice of ``tensor`` (a piece of its box's shape, or a whole tensor
        it cuts its box from).

        A quantized weight's scales (``<weight>_scale_inv``): those of the blocks its slice
        touches, received as they are or cut from every scale of the weight.

        Raises:
            KeyError: the model has no such parameter.
            ValueError: ``tensor`` is neither the box's shape nor the whole's.
        """
        weight = quantized_weight_of(name)
        if weight is not None and weight in self.layout.boxes and weight in params:
            box = scale_box(self.layout.boxes[weight], holds=False)
            target_shape = covered_blocks(params[weight].shape)
        else:
            target, box = params.get(name), self.layout.boxes.get(name)
            if target is None or box is None:
                raise KeyError(f"received weight {name!r}, which the rollout model lacks")
            target_shape = tuple(target.shape)
        if tuple(tensor.shape) == target_shape:
            return box.cut(tensor)
        if tuple(tensor.shape) != box.shape:
            raise ValueError(
                f"weight {name!r}: received shape {tuple(tensor.shape)}; tensor-parallel rank "
                f"{self.tp_rank} needs its slice {box} (shape {box.shape}) or the whole "
                f"{target_shape}")
        return tensor

    def check_staged_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Refuse, while it is staged, a tensor that is not this worker's slice nor whole."""
        self._own_slice(name, tensor, self.checkpoint_tensors())

    def swap_weights(self, tensors: dict[str, torch.Tensor], version: int | None
                     ) -> dict[str, torch.Tensor]:
        """Write this worker's slice of every staged tensor into its model, all or nothing
        (every one checked first): its slices live inside the whole parameters its peers'
        fill, so it copies its boxes rather than adopting tensors; returns copies of the
        slices it held."""
        params = self.checkpoint_tensors()
        pieces = dequantized(
            {name: self._own_slice(name, tensor, params) for name, tensor in tensors.items()},
            self._compute_dtype, self.offsets)
        self._check_whole(set(pieces), params, version)
        served = {name: self.layout.boxes[name].cut(params[name].detach()).clone()
                  for name in pieces}
        with torch.no_grad():
            for name, piece in pieces.items():
                self.layout.boxes[name].cut(params[name].detach()).copy_(piece)
        self._whole_version = None
        self.weights_version = version
        return served

    async def update_weights(
        self, weights: AsyncIterator[tuple[str, torch.Tensor]], global_steps: int | None = None
    ) -> None:
        """Keep this worker's slice of every tensor (a piece of its box's shape, or a whole
        tensor it cuts its box from); all must arrive."""
        params = self.checkpoint_tensors()

        async def own_slices() -> AsyncIterator[tuple[str, torch.Tensor]]:
            async for name, tensor in weights:
                yield name, self._own_slice(name, tensor, params)

        self._whole_version = None
        with torch.no_grad():
            slices = dequantized_stream(own_slices(), self._compute_dtype, self.offsets)
            await super().update_weights(_placed(slices, params, self.layout), global_steps)

    def tensor_parallel_slices(self) -> tuple[int | None, Slices]:
        """This worker's weights version and its slice of every tensor."""
        params = self.checkpoint_tensors()
        return self.weights_version, {
            name: ([list(r) for r in box.ranges], box.cut(params[name].detach()).clone())
            for name, box in self.layout.boxes.items()}

    async def make_whole(self) -> None:
        """Copy every peer's slices into this worker's model (once per weights version).

        Raises:
            RuntimeError: a peer serves another weights version, naming it.
        """
        async with self._assembling:
            if self._whole_version is not None and self._whole_version == self.weights_version:
                return
            replies = await asyncio.gather(*(peer.tensor_parallel_slices.remote()
                                             for peer in self.peers))
            params = self.checkpoint_tensors()
            with torch.no_grad():
                for index, (version, slices) in enumerate(replies):
                    if version != self.weights_version:
                        raise RuntimeError(
                            f"tensor-parallel rank {self.tp_rank}: peer {index} of its replica "
                            f"holds weights version {version}, this worker {self.weights_version}"
                            "; the replica is not served half-updated")
                    for name, (ranges, piece) in slices.items():
                        params[name][tuple(slice(a, b) for a, b in ranges)].copy_(piece)
            self._whole_version = self.weights_version

    async def generate_sample(
        self, prompt_ids: torch.Tensor, response_length: int, seed: int,
        adapter: tuple[str, int] | None = None,
    ) -> dict[str, Any]:
        """Sample with the whole model, assembled from the peers' slices first."""
        await self.make_whole()
        return await super().generate_sample(prompt_ids, response_length, seed, adapter)

    async def resume_generation(self) -> None:
        """Make the model whole from the peers' slices (every worker of the replica took the
        new version before it is resumed), then let parked generations continue on it."""
        if self.peers:
            await self.make_whole()
        await super().resume_generation()


async def _placed(slices: AsyncIterator[tuple[str, torch.Tensor]],
                  params: dict[str, torch.Tensor], layout: Layout
                  ) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Write each slice into its parameter at its box; yield the parameter itself (which
    the base class then leaves in place)."""
    async for name, piece in slices:
        target = params[name]
        layout.boxes[name].cut(target.detach()).copy_(piece)
        yield name, target.detach()
