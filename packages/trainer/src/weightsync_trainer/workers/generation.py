"""The inference server inside a rollout process: Hugging Face ``generate`` with a KV cache,
on a thread of its own, so that a staged sync streams in while it generates."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from transformers import GenerationMixin, StoppingCriteria, StoppingCriteriaList

from weightsync_core import AdapterSpec
from weightsync_core.data.quantization import (
    dequantize_fp8_block,
    dequantized,
    dequantized_stream,
    quantized_weight_of,
)
from weightsync_core.data.shards import per_expert_stream
from weightsync_trainer.checksum import weights_digest
from weightsync_trainer.config import ModelConfig
from weightsync_trainer.lora import base_parameters
from weightsync_trainer.modeling import build_policy_model
from weightsync_trainer.workers.pausing import GenerationAborted, GenerationGate, PauseMode
from weightsync_trainer.workers.served_adapters import ServedAdapters

__all__ = ["GenerationAborted", "HFGenerationServer"]


class _AtEveryToken(StoppingCriteria):
    """Runs after every generated token: notes when it came and the weights version it was
    sampled with, and parks or ends the generation as the server's gate says."""

    def __init__(self, server: HFGenerationServer) -> None:
        self.server = server
        self.token_times: list[float] = []
        self.versions: list[int | None] = []
        self.aborted = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor,
                 **kwargs: Any) -> torch.BoolTensor:
        self.token_times.append(time.monotonic())
        self.versions.append(self.server.weights_version)
        stop = self.server.gate.at_token()
        self.aborted = self.aborted or stop
        done = torch.full((input_ids.shape[0],), stop, dtype=torch.bool)
        return done  # pyright: ignore[reportReturnType]


class HFGenerationServer:
    """Samples responses with ``model.generate(use_cache=True)`` and loads new weights.

    It is the :class:`~weightsync_core.ServerAdapter` of a rollout worker (or, colocated, of an
    actor rank). Requests run one at a time on a thread of their own, so the worker's event
    loop keeps receiving a staged sync while they generate. A pause
    (:meth:`pause_generation`: ``keep`` parks requests in flight between two tokens, their KV
    cache kept, to continue on the new weights; ``drain`` lets them finish; ``abort`` ends
    them) holds new requests until :meth:`resume_generation`; ``abort_all_requests`` (a
    stop-the-world sync) drains. A staged commit swaps the staged tensors in as the
    parameters (:meth:`swap_weights`: no copy; the old ones are the rollback copy).
    ``generate`` allocates its KV cache per call, so there is no cache to release between
    requests. LoRA adapter syncs add versions beside the base weights (:meth:`load_adapter`,
    through PEFT: :class:`~.served_adapters.ServedAdapters`), on the request thread, between
    two requests; a request names the version it is served on (``adapter``).

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
        self.gate = GenerationGate()
        """Where generations park or end during a pause."""
        self._generating = ThreadPoolExecutor(1, thread_name_prefix="hf-generate")
        self.adapters = ServedAdapters(self.model)
        """The LoRA adapter versions it serves (used on the request thread only)."""

    async def generate(
        self, prompt_ids: torch.Tensor, response_length: int, seed: int,
        adapter: tuple[str, int] | None = None,
    ) -> torch.Tensor:
        """Sample one response of exactly ``response_length`` tokens per prompt row (on
        version ``adapter[1]`` of LoRA adapter ``adapter[0]`` where given)."""
        return (await self.generate_sample(prompt_ids, response_length, seed,
                                           adapter))["tokens"]

    async def generate_sample(
        self, prompt_ids: torch.Tensor, response_length: int, seed: int,
        adapter: tuple[str, int] | None = None,
    ) -> dict[str, Any]:
        """Sample one response of exactly ``response_length`` tokens per prompt row, with
        what produced it: ``{"tokens", "log_probs" (of each token under the weights and
        temperature that sampled it), "versions" (the weights version each token was
        sampled with: a ``keep`` pause may switch it mid-response), "token_times"
        (``time.monotonic()`` as each token came)}``.

        Raises:
            GenerationAborted: an ``abort`` pause ended it; send it again.
            WeightSyncError: this server holds no such adapter version.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._generating, self._sample, prompt_ids,
                                          response_length, seed, adapter)

    def _sample(self, prompt_ids: torch.Tensor, response_length: int, seed: int,
                adapter: tuple[str, int] | None = None) -> dict[str, Any]:
        """:meth:`generate_sample` on the generation thread."""
        self.gate.enter()
        try:
            self.adapters.activate(adapter)
            watch = _AtEveryToken(self)
            torch.manual_seed(seed)
            with torch.no_grad():
                # transformers types generate()'s self as a protocol its models do not match
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
                    stopping_criteria=StoppingCriteriaList([watch]),
                    output_scores=True,
                    return_dict_in_generate=True,
                )
        finally:
            self.gate.leave()
        if watch.aborted:
            raise GenerationAborted(
                f"the request was aborted after {len(watch.token_times)} of "
                f"{response_length} tokens by a pause for new weights; send it again")
        tokens = output.sequences[:, prompt_ids.shape[1]:]
        # the scores are the logits as sampled from (after the temperature)
        scores = torch.stack(output.scores, dim=1).float()
        log_probs = torch.log_softmax(scores, dim=-1).gather(-1, tokens.unsqueeze(-1))
        return {"tokens": tokens, "log_probs": log_probs.squeeze(-1),
                "versions": watch.versions, "token_times": watch.token_times}

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The model's parameters under the names syncs give them (a checkpoint's): each
        parameter itself, but experts a transformers 5 mixture of experts holds fused, one
        view of the fused parameter per expert's ``gate_proj``, ``up_proj`` and
        ``down_proj`` (writing into it writes the parameter)."""
        return dict(per_expert_stream(base_parameters(self.model.named_parameters())))

    def _target(self, name: str, tensor: torch.Tensor,
                params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The parameter ``name`` loads into.

        Raises:
            KeyError: the model has no such parameter.
            ValueError: ``tensor`` has another shape.
        """
        target = params.get(name)
        if target is None:
            raise KeyError(f"received weight {name!r}, which the rollout model lacks")
        if target.shape != tensor.shape:
            raise ValueError(f"weight {name!r}: received shape {tuple(tensor.shape)}, the "
                             f"rollout model has {tuple(target.shape)}")
        return target

    @staticmethod
    def _check_whole(names: set[str], params: Mapping[str, Any], version: int | None) -> None:
        missing = set(params) - names
        if missing:
            raise ValueError(f"weight update {version} lacked {len(missing)} parameters, e.g. "
                             f"{sorted(missing)[:3]}")

    def check_staged_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Refuse, while it is staged, a tensor this model could not load (see
        :meth:`_target`; a quantized weight's scales: one per block of the weight)."""
        params = self.checkpoint_tensors()
        weight = quantized_weight_of(name)
        if weight is None:
            self._target(name, tensor, params)
            return
        target = params.get(weight)
        if target is None or target.dim() != 2:
            raise KeyError(f"received scales {name!r} for {weight!r}, which the rollout model "
                           "lacks (or is not a matrix)")
        dequantize_fp8_block(torch.zeros(target.shape, dtype=torch.float8_e4m3fn), tensor)

    @property
    def _compute_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    async def update_weights(
        self, weights: AsyncIterator[tuple[str, torch.Tensor]], global_steps: int | None = None
    ) -> None:
        """Copy every received tensor into the parameter of that name (unless it is that
        parameter, patched in place by a delta sync; a float8 weight dequantized with its
        scales); all must arrive."""
        params = self.checkpoint_tensors()
        seen: set[str] = set()
        with torch.no_grad():
            async for name, tensor in dequantized_stream(weights, self._compute_dtype):
                target = self._target(name, tensor, params)
                if tensor.data_ptr() != target.data_ptr():
                    target.copy_(tensor)
                seen.add(name)
        self._check_whole(seen, params, global_steps)
        self.weights_version = global_steps

    def swap_weights(self, tensors: dict[str, torch.Tensor], version: int | None
                     ) -> dict[str, torch.Tensor]:
        """Adopt ``tensors`` (a staged version, every parameter by name) as the parameters'
        data, all or nothing (every one is checked first), under a pause; return the
        tensors they held (the version served until now). Float8 weights are dequantized
        with their scales first. An expert of a fused parameter is a view of it: its new
        values are copied in, and the values it held returned as a copy."""
        params = self.checkpoint_tensors()
        adopted = {}
        for name, tensor in dequantized(tensors, self._compute_dtype).items():
            target = self._target(name, tensor, params)
            adopted[name] = tensor.to(device=target.device, dtype=target.dtype).contiguous()
        self._check_whole(set(adopted), params, version)
        served = {}
        with torch.no_grad():
            for name, tensor in adopted.items():
                target = params[name]
                if isinstance(target, torch.nn.Parameter):
                    served[name] = target.data
                    target.data = tensor
                else:
                    served[name] = target.detach().clone()
                    target.copy_(tensor)
        self.weights_version = version
        return served

    def patchable_weights(self) -> dict[str, torch.Tensor]:
        """The parameters by name, which delta syncs patch in place (where they arrive in
        the parameters' dtype) instead of keeping a copy of their own."""
        return {name: tensor.detach() for name, tensor in self.checkpoint_tensors().items()}

    def check_adapter(self, spec: AdapterSpec) -> None:
        """Refuse an adapter whose target modules the model lacks."""
        self.adapters.check(spec)

    async def load_adapter(self, spec: AdapterSpec, version: int,
                           tensors: dict[str, torch.Tensor]) -> None:
        """Serve ``version`` of LoRA adapter ``spec.name`` beside the versions it serves
        (between two requests, on the request thread)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._generating, self.adapters.load, spec, version,
                                   tensors)

    async def drop_adapter(self, name: str, version: int) -> None:
        """Stop serving ``version`` of LoRA adapter ``name`` (between two requests)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._generating, self.adapters.drop, name, version)

    async def abort_all_requests(self) -> None:
        """Pause for a stop-the-world sync: requests in flight finish, new ones wait until
        :meth:`resume_generation`."""
        await self.gate.pause("drain")

    async def pause_generation(self, mode: PauseMode = "keep") -> None:
        """Pause for a staged commit (see :class:`~.pausing.GenerationGate`)."""
        await self.gate.pause(mode)

    async def resume_generation(self) -> None:
        """Serve again (with the new weights)."""
        self.gate.resume()

    def weights_checksum(self) -> str:
        """Digest of the served weights (compare with the actor's)."""
        return weights_digest(base_parameters(self.model.named_parameters()))
