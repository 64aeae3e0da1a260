"""Deterministic test weights covering every case a backend must deliver bit-exactly."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import xxhash

from weightsync_core.data.adapters import AdapterSpec
from weightsync_core.data.bucketing import as_bytes, cast_for_rollout
from weightsync_core.data.shards.experts import MoEShape
from weightsync_core.data.shards.tensor_parallel import DecoderShape

__all__ = [
    "DECODER",
    "DECODER_BLOCKS",
    "MOE",
    "ONE_ELEMENT",
    "Faults",
    "TensorDigest",
    "convert_in_place",
    "digest",
    "digests",
    "faulty_stream",
    "make_adapter",
    "make_weights",
    "sparse_updates",
]

TensorDigest = tuple[tuple[int, ...], str, int]
"""``(shape, dtype name, xxh3 of the bytes)`` of one tensor."""


def _float8_dtypes() -> list[torch.dtype]:
    names = ("float8_e4m3fn", "float8_e5m2")
    return [getattr(torch, name) for name in names if hasattr(torch, name)]


def make_weights(
    seed: int, bucket_size: int, profile: str = "standard"
) -> dict[str, torch.Tensor]:
    """Weights for one sync, fully determined by ``seed``.

    Profiles:
        ``standard``: every dtype in use (fp32, bf16, fp16, fp64, fp8 where torch has it,
            int8/16/32/64, uint8, bool), 0-dim, empty and non-contiguous tensors, one tensor
            just over 5x the bucket size and 200 tiny tensors.
        ``tiny``: 3000 tensors of a few elements each.
        ``buckets``: 4 buckets' worth of float32 tensors, 32 to a bucket (every bucket
            holds whole tensors a server reads straight out of it).
        ``large``: ``standard`` plus a tensor of about 1 GiB split over many buckets (not
            used by default: it is for manual runs).
        ``decoder``: a two-layer Qwen2-style model of :data:`DECODER`'s geometry, in
            Hugging Face names (a vocabulary of 100 rows, not a multiple of vLLM's padding;
            norms of 33 rows, which do not split evenly; q/k/v biases).
        ``decoder_blocks``: ``decoder`` of :data:`DECODER_BLOCKS`'s geometry (hidden size
            256): weights of several 128x128 blocks, some of rows and columns that are not
            multiples of 128, for quantization by block.
        ``moe``: a two-layer Qwen2-MoE-style model of :data:`MOE`'s geometry, in Hugging
            Face names: layer 0 a mixture of experts (router, 4 experts named per expert,
            a shared expert and its gate), layer 1 a dense MLP; otherwise as ``decoder``.
        ``moe_fused``: ``moe`` with each layer's experts fused as transformers 5 holds them
            (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]): the same
            values, so its :func:`~weightsync_core.data.shards.per_expert_stream` is
            ``moe`` exactly.
        ``rollout_floats``: ``standard`` less what an engine that casts every tensor to its
            rollout dtype and holds each tensor in one bucket cannot deliver (verl's
            Mooncake engine): its floating-point tensors under a bucket's size.
    """
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    def randint(low: int, high: int, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=generator, dtype=dtype)

    if profile == "tiny":
        return {f"tiny.{index}": randn(3 + index % 5) for index in range(3000)}
    if profile == "decoder":
        return _decoder_weights(randn)
    if profile == "decoder_blocks":
        return _decoder_weights(randn, DECODER_BLOCKS)
    if profile in ("moe", "moe_fused"):
        return _moe_weights(randn, fused=profile == "moe_fused")
    if profile == "buckets":  # a little under 1/32 of a bucket each, alignment included
        return {f"layer.{index}": randn(bucket_size // 32 // 4 - 64) for index in range(128)}
    weights: dict[str, torch.Tensor] = {
        "model.embed.weight": randn(97, 33),
        "model.bf16": randn(64, 7).to(torch.bfloat16),
        "model.fp16": randn(5, 13).to(torch.float16),
        "model.fp64": randn(11).to(torch.float64),
        "model.int8": randint(-128, 128, 300, dtype=torch.int8),
        "model.int16": randint(-30000, 30000, 77, dtype=torch.int16),
        "model.int32": randint(-(2**31), 2**31 - 1, 19, dtype=torch.int32),
        "model.int64": randint(-(2**62), 2**62, 23, dtype=torch.int64),
        "model.uint8": randint(0, 256, 129, dtype=torch.uint8),
        "model.bool": randint(0, 2, 31, dtype=torch.int64).bool(),
        "model.scalar": randn(1).reshape(()),
        "model.scalar_int": torch.tensor(seed, dtype=torch.int64),
        "model.empty": torch.empty(0, 7),
        "model.empty_bf16": torch.empty(3, 0, dtype=torch.bfloat16),
        "model.transposed": randn(24, 40).t(),
        "model.strided": randn(301)[::3],
        "model.big": randn(5 * bucket_size // 4 + 123),
    }
    for dtype in _float8_dtypes():
        weights[f"model.{str(dtype).removeprefix('torch.')}"] = randn(8, 9).to(dtype)
    for index in range(200):
        weights[f"model.tiny.{index}"] = randn(1 + index % 4)
    if profile == "large":
        weights["model.huge"] = randn(256 << 20)
    elif profile == "rollout_floats":
        weights = {name: tensor for name, tensor in weights.items()
                   if tensor.is_floating_point() and tensor.nbytes < bucket_size}
    elif profile != "standard":
        raise ValueError(f"unknown weights profile {profile!r}: use standard, tiny, buckets, "
                         "decoder, decoder_blocks, moe, moe_fused, large or rollout_floats")
    return weights


DECODER = DecoderShape(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=48)
"""The geometry of the ``decoder`` weights profile (hidden size 32)."""

DECODER_BLOCKS = DecoderShape(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              intermediate_size=320)
"""The geometry of the ``decoder_blocks`` weights profile (hidden size 256; k/v of 128
rows; an MLP of 320, two and a half blocks)."""


def _decoder_weights(randn: Callable[..., torch.Tensor], shape: DecoderShape = DECODER
                     ) -> dict[str, torch.Tensor]:
    hidden, vocab = shape.num_attention_heads * shape.head_dim, 100
    heads, kv = hidden, shape.num_key_value_heads * shape.head_dim
    weights = {"model.embed_tokens.weight": randn(vocab, hidden)}
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        weights.update({
            f"{prefix}.input_layernorm.weight": randn(hidden),
            f"{prefix}.self_attn.q_proj.weight": randn(heads, hidden),
            f"{prefix}.self_attn.q_proj.bias": randn(heads),
            f"{prefix}.self_attn.k_proj.weight": randn(kv, hidden),
            f"{prefix}.self_attn.k_proj.bias": randn(kv),
            f"{prefix}.self_attn.v_proj.weight": randn(kv, hidden),
            f"{prefix}.self_attn.v_proj.bias": randn(kv),
            f"{prefix}.self_attn.o_proj.weight": randn(hidden, heads),
            f"{prefix}.post_attention_layernorm.weight": randn(hidden),
            f"{prefix}.mlp.gate_proj.weight": randn(shape.intermediate_size, hidden),
            f"{prefix}.mlp.up_proj.weight": randn(shape.intermediate_size, hidden),
            f"{prefix}.mlp.down_proj.weight": randn(hidden, shape.intermediate_size),
        })
    weights["model.norm.weight"] = randn(33)
    weights["lm_head.weight"] = randn(vocab, hidden)
    return weights


MOE = MoEShape(DECODER, num_experts=4, moe_intermediate_size=16,
               shared_expert_intermediate_size=24)
"""The geometry of the ``moe`` weights profile (hidden size 32)."""


def _moe_weights(randn: Callable[..., torch.Tensor], fused: bool) -> dict[str, torch.Tensor]:
    hidden, width = 32, MOE.moe_intermediate_size
    shared = MOE.shared_expert_intermediate_size or 0
    dense = _decoder_weights(randn)
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in dense.items():
        if not name.startswith("model.layers.0.mlp."):
            weights[name] = tensor
            continue
        if not name.endswith("down_proj.weight"):
            continue
        prefix = "model.layers.0.mlp"  # layer 0's dense MLP becomes a mixture of experts
        weights[f"{prefix}.gate.weight"] = randn(MOE.num_experts, hidden)
        gate_up = randn(MOE.num_experts, 2 * width, hidden)
        down = randn(MOE.num_experts, hidden, width)
        if fused:
            weights[f"{prefix}.experts.gate_up_proj"] = gate_up
            weights[f"{prefix}.experts.down_proj"] = down
        else:
            for expert in range(MOE.num_experts):
                weights[f"{prefix}.experts.{expert}.gate_proj.weight"] = gate_up[expert, :width]
                weights[f"{prefix}.experts.{expert}.up_proj.weight"] = gate_up[expert, width:]
            for expert in range(MOE.num_experts):
                weights[f"{prefix}.experts.{expert}.down_proj.weight"] = down[expert]
        weights[f"{prefix}.shared_expert.gate_proj.weight"] = randn(shared, hidden)
        weights[f"{prefix}.shared_expert.up_proj.weight"] = randn(shared, hidden)
        weights[f"{prefix}.shared_expert.down_proj.weight"] = randn(hidden, shared)
        weights[f"{prefix}.shared_expert_gate.weight"] = randn(1, hidden)
    return weights


ONE_ELEMENT = -1.0
"""A :func:`sparse_updates` fraction that changes exactly one element of each tensor."""


def make_adapter(spec: AdapterSpec, seed: int, layers: int = 2, hidden: int = 64,
                 updates: Sequence[tuple[int, float]] = ()) -> dict[str, torch.Tensor]:
    """A LoRA adapter of ``spec`` for a decoder of ``layers`` layers of width ``hidden``
    (float32, named as PEFT's ``get_peft_model_state_dict`` names them: every target
    module of every layer, ``lora_A`` ``[rank, hidden]`` then ``lora_B`` ``[hidden,
    rank]``), from ``seed``, after the sparse ``updates`` (:func:`sparse_updates`)."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for module in spec.target_modules:
            path = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{path}.lora_A.weight"] = torch.randn(spec.rank, hidden,
                                                           generator=generator)
            tensors[f"{path}.lora_B.weight"] = torch.randn(hidden, spec.rank,
                                                           generator=generator)
    return sparse_updates(tensors, updates)


def sparse_updates(
    weights: Mapping[str, torch.Tensor], updates: Sequence[tuple[int, float]]
) -> dict[str, torch.Tensor]:
    """``weights`` after each ``(seed, fraction)`` update in turn, as an optimizer step
    leaves rollout weights: about ``fraction`` of each tensor's elements (chosen from
    ``seed``) get new values (``0.0``: none, ``1.0``: all, :data:`ONE_ELEMENT`: one); the
    rest stay bitwise the same. Deterministic: every caller gets the same tensors."""
    updated = dict(weights)
    for seed, fraction in updates:
        generator = torch.Generator().manual_seed(seed)
        for name, tensor in updated.items():
            updated[name] = _updated(tensor, fraction, generator)
    return updated


def _updated(tensor: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor:
    flat = tensor.contiguous().reshape(-1).clone()
    count = flat.numel()
    if count == 0 or fraction == 0.0:
        return flat.reshape(tensor.shape)
    if fraction == ONE_ELEMENT:
        mask = torch.zeros(count, dtype=torch.bool)
        mask[int(torch.randint(0, count, (1,), generator=generator))] = True
    else:
        mask = torch.rand(count, generator=generator) < fraction
    changed = int(mask.sum())
    if flat.dtype == torch.bool:
        flat[mask] = ~flat[mask]
    elif flat.is_floating_point():
        wide = flat.to(torch.float64)
        wide[mask] = wide[mask] + 1.0 + torch.rand(changed, generator=generator,
                                                   dtype=torch.float64)
        flat = wide.to(flat.dtype)
    else:
        flat[mask] = flat[mask] ^ 1
    return flat.reshape(tensor.shape)


def digest(tensor: torch.Tensor) -> TensorDigest:
    """Shape, dtype and a 64-bit hash of the bytes: equal digests mean bit-exact tensors."""
    data = as_bytes(tensor.detach().cpu())
    payload = data.numpy().data if data.numel() else b""
    return tuple(tensor.shape), str(tensor.dtype), xxhash.xxh3_64_intdigest(payload)


def convert_in_place(tensor: torch.Tensor) -> None:
    """Change every element of ``tensor`` where it lives, keeping its dtype, shape and
    storage (flip the lowest bit of each byte), as a server's in-place conversion on load
    (a ``mul_``, a ``copy_`` into it) would."""
    converted = tensor.contiguous()
    converted.reshape(-1).view(torch.uint8).bitwise_xor_(1)
    if converted is not tensor:
        tensor.copy_(converted)


def digests(
    weights: Mapping[str, torch.Tensor], rollout_dtype: torch.dtype | None = None
) -> dict[str, TensorDigest]:
    """Digest of every tensor as a receiver should see it (after the rollout cast)."""
    return {name: digest(cast_for_rollout(t, rollout_dtype)) for name, t in weights.items()}


@dataclass
class Faults:
    """Failures a test can inject on the sending side."""

    raise_after: int | None = None
    duplicate_name: bool = False
    non_tensor: bool = False
    empty: bool = False
    """Yield nothing at all."""
    die_after: int | None = None
    """Kill the sending process after that many tensors."""
    reshape: str | None = None
    """Send this tensor flattened (a changed manifest)."""
    omit: str | None = None
    """Leave this tensor out (a missing tensor)."""
    rename: str | None = None
    """Send this tensor under a name the model does not have (its name, ``.unknown``
    appended)."""


def faulty_stream(
    weights: Mapping[str, torch.Tensor], faults: Faults
) -> Iterator[tuple[str, object]]:
    """Yield ``weights`` as pairs, misbehaving as ``faults`` says."""
    if faults.empty:
        return
    for index, (name, tensor) in enumerate(weights.items()):
        if faults.raise_after is not None and index == faults.raise_after:
            raise RuntimeError(f"injected failure in the weight generator after {index} tensors")
        if faults.die_after is not None and index == faults.die_after:
            os._exit(1)
        if name == faults.omit:
            continue
        sent_name = f"{name}.unknown" if name == faults.rename else name
        yield sent_name, tensor.reshape(-1) if name == faults.reshape else tensor
        if index == 3 and faults.duplicate_name:
            yield name, tensor
        if index == 3 and faults.non_tensor:
            yield "model.not_a_tensor", [1.0, 2.0]
