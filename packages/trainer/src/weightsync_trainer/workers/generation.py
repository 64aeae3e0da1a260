"""The inference server inside a rollout process: Hugging Face ``generate`` with a KV cache."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch
from transformers import GenerationMixin

from weightsync_trainer.checksum import weights_digest
from weightsync_trainer.config import ModelConfig
from weightsync_trainer.modeling import build_policy_model

__all__ = ["HFGenerationServer"]


class HFGenerationServer:
    """Samples responses with ``model.generate(use_cache=True)`` and loads new weights.

    It is the :class:`~weightsync_core.ServerAdapter` of a rollout worker (or, colocated, of an
    actor rank). Generation runs to completion inside one call, so ``abort_all_requests``
    pauses the server: requests arriving during a weight sync wait until
    ``resume_generation``. ``generate`` allocates its KV cache per call, so there is no cache
    to release between requests.

    Args:
        model: the model to build.
        temperature: the sampling temperature.
        dtype: the dtype the model serves in (the syncs' ``rollout_dtype``; None: fp32).
    """

    def __init__(self, model: ModelConfig, temperature: float,
                 dtype: torch.dtype | None = None) -> None:
        policy = build_policy_model(model).eval()
        if dtype is not None:
            # in place; transformers types to() so that pyright finds no self to bind
            policy.to(dtype=dtype)  # pyright: ignore[reportCallIssue]
        if not isinstance(policy, GenerationMixin):
            raise TypeError(
                f"model_type {model.model_type!r} builds a {type(policy).__name__}, which "
                "cannot generate (not a transformers GenerationMixin)"
            )
        self.model = policy
        self.temperature = temperature
        self.weights_version: int | None = None
        self._serving = asyncio.Event()
        self._serving.set()

    async def generate(
        self, prompt_ids: torch.Tensor, response_length: int, seed: int
    ) -> torch.Tensor:
        """Sample one response of exactly ``response_length`` tokens per prompt row."""
        await self._serving.wait()
        torch.manual_seed(seed)
        with torch.no_grad():
            # transformers types generate()'s self as a protocol its own models do not match
            output = self.model.generate(  # pyright: ignore[reportAttributeAccessIssue]
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                do_sample=True,
                temperature=self.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=response_length,
                use_cache=True,
                pad_token_id=0,
            )
        return output[:, prompt_ids.shape[1] :]

    async def update_weights(
        self, weights: AsyncIterator[tuple[str, torch.Tensor]], global_steps: int | None = None
    ) -> None:
        """Copy every received tensor into the parameter of that name (unless it is that
        parameter, patched in place by a delta sync); all must arrive."""
        params = dict(self.model.named_parameters())
        missing = set(params)
        with torch.no_grad():
            async for name, tensor in weights:
                target = params.get(name)
                if target is None:
                    raise KeyError(f"received weight {name!r}, which the rollout model lacks")
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"weight {name!r}: received shape {tuple(tensor.shape)}, the rollout "
                        f"model has {tuple(target.shape)}"
                    )
                if tensor.data_ptr() != target.data_ptr():
                    target.copy_(tensor)
                missing.discard(name)
        if missing:
            raise ValueError(
                f"weight update {global_steps} lacked {len(missing)} parameters, e.g. "
                f"{sorted(missing)[:3]}"
            )
        self.weights_version = global_steps

    def patchable_weights(self) -> dict[str, torch.Tensor]:
        """The parameters by name, which delta syncs patch in place (where they arrive in
        the parameters' dtype) instead of keeping a copy of their own."""
        return {name: param.detach() for name, param in self.model.named_parameters()}

    async def abort_all_requests(self) -> None:
        """Pause: new requests wait until :meth:`resume_generation`."""
        self._serving.clear()

    async def resume_generation(self) -> None:
        """Serve again (with the new weights)."""
        self._serving.set()

    def weights_checksum(self) -> str:
        """Digest of the served weights (compare with the actor's)."""
        return weights_digest(self.model.named_parameters())
