"""Mixture-of-experts layouts (the Qwen2-MoE/Qwen3-MoE family, Hugging Face names): what a
tensor-parallel or expert-parallel vLLM worker needs, what an FSDP2 rank of fused expert
tensors holds, and fused expert tensors streamed one expert at a time, as views.

Experts are stored two ways. Checkpoints (and vLLM's loader) name them one tensor per expert,
``<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight`` ([I, H], [I, H], [H, I]); transformers
5 holds them fused in memory, ``<layer>.mlp.experts.gate_up_proj`` [E, 2I, H] (each expert's
gate rows, then its up rows) and ``<layer>.mlp.experts.down_proj`` [E, H, I].
:func:`per_expert_stream` turns the fused ones into the per-expert names without copying.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from weightsync_core.data.shards.box import Box
from weightsync_core.data.shards.layout import Layout, Shapes, fsdp_layout
from weightsync_core.data.shards.tensor_parallel import (
    DecoderShape,
    SplitSize,
    decoder_tensor_parallel_layout,
    misfit,
    refuse_misfits,
)

__all__ = [
    "MoEShape",
    "experts_of_rank",
    "fsdp_first_expert",
    "fsdp_fused_experts_layout",
    "fused_experts",
    "moe_layout",
    "per_expert_shapes",
    "per_expert_stream",
]

_PER_EXPERT = re.compile(
    r"^(?P<experts>.*\.experts)\.(?P<expert>\d+)\.(?P<projection>gate_proj|up_proj|down_proj)"
    r"\.weight$")
_FUSED = re.compile(r"^(?P<experts>.*\.experts)\.(?P<projection>gate_up_proj|down_proj)$")
_SHARED_IN = re.compile(r"\.mlp\.shared_expert\.(gate|up)_proj\.weight$")
_SHARED_OUT = re.compile(r"\.mlp\.shared_expert\.down_proj\.weight$")

_Value = TypeVar("_Value")


@dataclass(frozen=True)
class MoEShape:
    """The geometry of a mixture-of-experts decoder (a Qwen2-MoE/Qwen3-MoE config's fields).

    Args:
        decoder: attention, dense MLP layers' width and vocabulary, as for a dense model.
        num_experts: routed experts per MoE layer.
        moe_intermediate_size: each routed expert's width (``I``).
        shared_expert_intermediate_size: the shared expert's width, where the model has one
            (Qwen2-MoE; None: no shared expert).

    Raises:
        ValueError: a field that is not a positive integer, named.
    """

    decoder: DecoderShape
    num_experts: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if value is None and name == "shared_expert_intermediate_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEShape {name} must be a positive integer, got {value!r}: "
                                 "give the model's geometry as its Hugging Face config states "
                                 "it (MoEShape.from_hf_config)")

    @classmethod
    def from_hf_config(cls, config: Any) -> MoEShape:
        """The geometry of a Hugging Face MoE config (``num_experts``,
        ``moe_intermediate_size``, ``shared_expert_intermediate_size`` where present and
        not 0; the rest as :meth:`DecoderShape.from_hf_config`).

        Raises:
            ValueError: a config without ``num_experts`` or ``moe_intermediate_size`` (not a
                mixture of experts of this family), or a field that is not a positive
                integer, named.
        """
        text = getattr(config, "text_config", None) or config
        missing = [field for field in ("num_experts", "moe_intermediate_size")
                   if not getattr(text, field, None)]
        if missing:
            raise ValueError(f"the model config has no {' or '.join(missing)}: not a "
                             "Qwen2-MoE/Qwen3-MoE-family mixture of experts; declare a dense "
                             "model with DecoderShape.from_hf_config")
        shared = getattr(text, "shared_expert_intermediate_size", None) or None
        return cls(DecoderShape.from_hf_config(config), int(text.num_experts),
                   int(text.moe_intermediate_size), None if shared is None else int(shared))

    def as_fields(self) -> dict[str, int]:
        """The fields as plain data, the decoder's flattened in (those not given left out)."""
        fields = {**self.decoder.as_fields(), "num_experts": self.num_experts,
                  "moe_intermediate_size": self.moe_intermediate_size}
        if self.shared_expert_intermediate_size is not None:
            fields["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return fields

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> MoEShape:
        """The geometry of :meth:`as_fields`.

        Raises:
            TypeError: an unknown or missing field.
            ValueError: a field that is not a positive integer, named.
        """
        decoder = dict(fields)
        moe = {name: decoder.pop(name) for name in
               ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size")
               if name in decoder}
        return cls(DecoderShape(**decoder), **moe)

    def check(self, tp_size: int, expert_parallel: bool) -> None:
        """Raise where vLLM could not split this model over ``tp_size`` workers (with
        ``expert_parallel``: its experts over them, one expert-parallel rank per worker).

        Raises:
            ValueError: naming the dimension that does not divide.
        """
        self.decoder.check(tp_size)
        widths = [("shared_expert_intermediate_size", self.shared_expert_intermediate_size)]
        if expert_parallel:
            if self.num_experts < tp_size:
                raise ValueError(f"num_experts {self.num_experts} is fewer than the "
                                 f"{tp_size} expert-parallel ranks: some would hold none")
        else:
            widths.append(("moe_intermediate_size", self.moe_intermediate_size))
        for what, size in widths:
            if size is not None and size % tp_size:
                raise ValueError(f"{what} {size} does not divide into {tp_size} "
                                 "tensor-parallel ranks")


def experts_of_rank(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The experts expert-parallel rank ``ep_rank`` of ``ep_size`` holds, as vLLM places them
    (``linear``): consecutive runs, the first ``num_experts % ep_size`` ranks one more."""
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


def moe_layout(shapes: Shapes, model: MoEShape, tp_size: int, tp_rank: int,
               expert_parallel: bool = False) -> Layout:
    """What rank ``tp_rank`` of a vLLM engine of ``tp_size`` workers needs of a
    Qwen2-MoE/Qwen3-MoE checkpoint, as vLLM shards it: attention, embeddings and dense MLP
    layers as :func:`decoder_tensor_parallel_layout`, the router (``mlp.gate``) and the
    shared expert's gate whole, the shared expert split like a dense MLP of
    ``shared_expert_intermediate_size``; the routed experts, without ``expert_parallel``,
    each split over the workers like a dense MLP of ``moe_intermediate_size`` (gate and up
    by rows, down by columns) and, with it, whole, each worker holding the experts of
    :func:`experts_of_rank` and none of the others.

    Experts may be named per expert or fused (see the module); a fused ``gate_up_proj``
    holds each expert's gate and up rows one after the other, so a worker's rows of it are
    two boxes, not one: it is refused with the split over experts off, naming the fix
    (stream it per expert, :func:`per_expert_stream`).

    Raises:
        ValueError: a rank outside ``0 .. tp_size - 1``, a model vLLM cannot split so, or a
            tensor whose shape this geometry does not fit (naming the tensor, its shape, the
            geometry's size and the fix).
    """
    model.check(tp_size, expert_parallel)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} is not a rank of {tp_size}")
    experts = {name: shape for name, shape in shapes.items() if _is_expert_tensor(name)}
    dense = decoder_tensor_parallel_layout(
        {name: shape for name, shape in shapes.items() if name not in experts}, model.decoder,
        tp_size, tp_rank)
    boxes = dict(dense.boxes)
    misfits: list[str] = []
    width = model.moe_intermediate_size
    routed = SplitSize(width, "moe_intermediate_size", 1, "moe_intermediate_size")
    shared_width = model.shared_expert_intermediate_size
    shared = None if shared_width is None else SplitSize(
        shared_width, "shared_expert_intermediate_size", 1, "shared_expert_intermediate_size")
    owned = experts_of_rank(model.num_experts, tp_size, tp_rank)
    for name, shape in experts.items():
        if _SHARED_IN.search(name) or _SHARED_OUT.search(name):
            if shared is None:
                misfits.append(f"tensor {name!r} is a shared expert's, but the declared "
                               "geometry has no shared_expert_intermediate_size")
                continue
            dim = 0 if _SHARED_IN.search(name) else 1
            share = shared.size // tp_size
            misfits += (found := misfit(name, shape, dim, shared))
            if not found:
                boxes[name] = Box.along(shape, dim, tp_rank * share, (tp_rank + 1) * share)
            continue
        box = (_per_expert_box(name, shape, model, routed, tp_size, tp_rank, expert_parallel,
                               owned, misfits) if _PER_EXPERT.match(name) else
               _fused_box(name, shape, model, routed, tp_size, tp_rank, expert_parallel, owned,
                          misfits))
        if box is not None:
            boxes[name] = box
    refuse_misfits(misfits, "MoEShape")
    return Layout(boxes, empty_by_design=dense.empty_by_design)


def _is_expert_tensor(name: str) -> bool:
    return bool(_PER_EXPERT.match(name) or _FUSED.match(name) or _SHARED_IN.search(name)
                or _SHARED_OUT.search(name))


def _per_expert_box(name: str, shape: tuple[int, ...] | Any, model: MoEShape,
                    routed: SplitSize, tp_size: int, tp_rank: int, expert_parallel: bool,
                    owned: range, misfits: list[str]) -> Box | None:
    """The box of one expert's ``gate/up/down_proj`` (None: this worker needs none of it)."""
    match = _PER_EXPERT.match(name)
    assert match is not None
    expert = int(match["expert"])
    if expert >= model.num_experts:
        misfits.append(f"tensor {name!r} is expert {expert}'s, but the declared geometry has "
                       f"num_experts = {model.num_experts}")
        return None
    dim = 1 if match["projection"] == "down_proj" else 0
    found = misfit(name, shape, dim, routed)
    misfits += found
    if found:
        return None
    if expert_parallel:
        return Box.whole(shape) if expert in owned else None
    share = routed.size // tp_size
    return Box.along(shape, dim, tp_rank * share, (tp_rank + 1) * share)


def _fused_box(name: str, shape: tuple[int, ...] | Any, model: MoEShape, routed: SplitSize,
               tp_size: int, tp_rank: int, expert_parallel: bool, owned: range,
               misfits: list[str]) -> Box | None:
    """The box of a fused ``gate_up_proj`` [E, 2I, H] or ``down_proj`` [E, H, I]."""
    match = _FUSED.match(name)
    assert match is not None
    gate_up = match["projection"] == "gate_up_proj"
    count = SplitSize(model.num_experts, "num_experts", 1, "num_experts")
    dim = 1 if gate_up else 2
    split = (SplitSize(2 * routed.size, "2 x moe_intermediate_size", 2,
                       "moe_intermediate_size") if gate_up else routed)
    if len(shape) != 3:
        misfits.append(f"tensor {name!r} has shape {list(shape)}, but fused experts are "
                       "[experts, rows, columns]")
        return None
    found = misfit(name, shape, 0, count) + misfit(name, shape, dim, split)
    misfits += found
    if found:
        return None
    if expert_parallel:
        return Box.along(shape, 0, owned.start, owned.stop)
    if tp_size == 1:
        return Box.whole(shape)
    if gate_up:
        raise ValueError(
            f"tensor {name!r} holds each expert's gate rows and then its up rows, so a "
            f"tensor-parallel worker's share of it (rows of both halves) is not one box; "
            "stream fused experts one expert at a time (weightsync_core.data.shards."
            "per_expert_stream: views, no copy) or split the experts over the workers "
            "(expert_parallel)")
    share = routed.size // tp_size
    return Box.along(shape, 2, tp_rank * share, (tp_rank + 1) * share)


def fsdp_first_expert(num_experts: int, world_size: int, rank: int) -> int:
    """The first expert FSDP2 rank ``rank`` of ``world_size`` holds of a fused expert tensor
    (``Shard(0)`` splits as ``torch.chunk``: ``ceil(E / W)`` experts a rank): where its
    :func:`per_expert_stream` numbers from."""
    return rank * -(-num_experts // world_size)


def fsdp_fused_experts_layout(shapes: Shapes, world_size: int, rank: int) -> Layout:
    """What FSDP2 rank ``rank`` of ``world_size`` holds where the model keeps its experts
    fused (``Shard(0)`` over experts) but streams them per expert
    (:func:`per_expert_stream`): every per-expert tensor whole on the rank whose rows of the
    fused tensor hold that expert (``torch.chunk``'s split of each layer's experts, counted
    from the names), every other tensor as :func:`fsdp_layout`.

    Raises:
        ValueError: a rank outside ``0 .. world_size - 1``.
    """
    layout = fsdp_layout({name: shape for name, shape in shapes.items()
                          if not _PER_EXPERT.match(name)}, world_size, rank)
    counts: dict[str, int] = {}
    for name in shapes:
        if match := _PER_EXPERT.match(name):
            counts[match["experts"]] = max(counts.get(match["experts"], 0),
                                           int(match["expert"]) + 1)
    boxes = dict(layout.boxes)
    for name, shape in shapes.items():
        if match := _PER_EXPERT.match(name):
            experts = counts[match["experts"]]
            first = fsdp_first_expert(experts, world_size, rank)
            if first <= int(match["expert"]) < fsdp_first_expert(experts, world_size, rank + 1):
                boxes[name] = Box.whole(shape)
    return Layout(boxes, layout.replicated, layout.empty_by_design)


def fused_experts(shapes: Mapping[str, tuple[int, ...]]) -> int | None:
    """The experts of the fused expert tensors among ``shapes`` (a model's parameters'
    full shapes; their first dimension), or None where it holds none (a dense model, or
    experts one tensor per expert). An FSDP2 rank ``r`` of ``W`` holds experts from ``r *
    ceil(E / W)`` of each (:func:`fsdp_first_expert`).

    Raises:
        ValueError: fused tensors of different numbers of experts.
    """
    counts = {shape[0] for name, shape in shapes.items()
              if _FUSED.match(name) and len(shape) == 3}
    if len(counts) > 1:
        raise ValueError(f"fused expert tensors of {sorted(counts)} experts: one FSDP split "
                         "cannot hold whole experts of each")
    return counts.pop() if counts else None


def per_expert_stream(weights: Iterable[tuple[str, torch.Tensor]], first_expert: int = 0
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each fused ``experts.gate_up_proj`` [E, 2I, H] and
    ``experts.down_proj`` [E, H, I] replaced by its experts' ``gate_proj``, ``up_proj`` and
    ``down_proj`` (checkpoint names, experts numbered from ``first_expert``: an FSDP rank's
    first expert), each a view of the fused tensor: nothing is copied, so streaming a fused
    tensor costs no more memory than the pieces the engine packs. Everything else passes
    through.

    Raises:
        ValueError: a fused ``gate_up_proj`` whose rows do not split into gate and up halves.
    """
    for name, tensor in weights:
        match = _FUSED.match(name)
        if match is None or tensor.dim() != 3:
            yield name, tensor
            continue
        for index in range(tensor.shape[0]):
            prefix = f"{match['experts']}.{first_expert + index}"
            if match["projection"] == "down_proj":
                yield f"{prefix}.down_proj.weight", tensor[index]
                continue
            rows = tensor.shape[1]
            if rows % 2:
                raise ValueError(f"tensor {name!r} of shape {list(tensor.shape)}: {rows} rows "
                                 "do not split into an expert's gate and up halves")
            yield f"{prefix}.gate_proj.weight", tensor[index, :rows // 2]
            yield f"{prefix}.up_proj.weight", tensor[index, rows // 2:]


def per_expert_shapes(weights: Mapping[str, tuple[tuple[int, ...], _Value]]
                      ) -> dict[str, tuple[tuple[int, ...], _Value]]:
    """The full shapes (and whatever rides along, a dtype) of :func:`per_expert_stream`'s
    tensors, from the fused tensors' full shapes, in the same order."""
    shapes: dict[str, tuple[tuple[int, ...], _Value]] = {}
    for name, (shape, extra) in weights.items():
        match = _FUSED.match(name)
        if match is None or len(shape) != 3:
            shapes[name] = (shape, extra)
            continue
        experts, rows, columns = shape
        for index in range(experts):
            prefix = f"{match['experts']}.{index}"
            if match["projection"] == "down_proj":
                shapes[f"{prefix}.down_proj.weight"] = ((rows, columns), extra)
            else:
                shapes[f"{prefix}.gate_proj.weight"] = ((rows // 2, columns), extra)
                shapes[f"{prefix}.up_proj.weight"] = ((rows // 2, columns), extra)
    return shapes
