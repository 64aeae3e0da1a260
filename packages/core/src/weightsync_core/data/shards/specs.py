"""Layouts and weights as plain data, as processes declare them to the driver in
``prepare()`` (before the driver knows the tensors' shapes): what each spec names, resolved
against the shapes into a :class:`~weightsync_core.data.shards.layout.Layout`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weightsync_core.api.dtypes import parse_dtype
from weightsync_core.data.shards.box import Box
from weightsync_core.data.shards.experts import MoEShape, fsdp_fused_experts_layout, moe_layout
from weightsync_core.data.shards.layout import (
    Layout,
    LayoutMismatchError,
    Shapes,
    check_coverage,
    fsdp_layout,
)
from weightsync_core.data.shards.quantized import scale_tensors, with_scale_boxes
from weightsync_core.data.shards.tensor_parallel import DecoderShape, decoder_tensor_parallel_layout
from weightsync_core.data.shards.transfers import TransferPlan, layout_problem
from weightsync_core.data.sync_layout import SyncLayout

__all__ = [
    "LayoutSpec",
    "boxes_spec",
    "fsdp_spec",
    "moe_spec",
    "parse_weights_spec",
    "plan_layouts",
    "resolve_layout",
    "tensor_parallel_spec",
    "weights_spec",
]

LayoutSpec = Mapping[str, Any]
"""``{"fsdp": {"world_size": W, "rank": r[, "fused_experts": true]}}``,
``{"tensor_parallel": {"size": S, "rank": r, <DecoderShape fields>}}``, ``{"moe": {"size":
S, "rank": r, "expert_parallel": bool, <MoEShape fields>}}`` or ``{"boxes": {name: [[start,
stop], ...]}}``; None (no spec): every tensor whole."""


def fsdp_spec(world_size: int, rank: int, fused_experts: bool = False) -> dict[str, Any]:
    """What FSDP2 rank ``rank`` of ``world_size`` holds (:func:`fsdp_layout`; with
    ``fused_experts``, of a model whose experts are fused and streamed per expert:
    :func:`~weightsync_core.data.shards.experts.fsdp_fused_experts_layout`)."""
    fields: dict[str, Any] = {"world_size": world_size, "rank": rank}
    if fused_experts:
        fields["fused_experts"] = True
    return {"fsdp": fields}


def moe_spec(model: MoEShape, size: int, rank: int, expert_parallel: bool = False
             ) -> dict[str, Any]:
    """What rank ``rank`` of a vLLM engine of ``size`` workers needs of a mixture-of-experts
    model, its experts split by tensor or (``expert_parallel``) by expert
    (:func:`~weightsync_core.data.shards.experts.moe_layout`)."""
    return {"moe": {"size": size, "rank": rank, "expert_parallel": expert_parallel,
                    **model.as_fields()}}


def tensor_parallel_spec(model: DecoderShape, size: int, rank: int) -> dict[str, Any]:
    """What tensor-parallel rank ``rank`` of ``size`` needs of a Qwen2/Llama-family model
    (:func:`decoder_tensor_parallel_layout`)."""
    return {"tensor_parallel": {"size": size, "rank": rank, **model.as_fields()}}


def boxes_spec(layout: Layout) -> dict[str, Any]:
    """An explicit layout."""
    return {"boxes": {name: [list(r) for r in box.ranges] for name, box in layout.boxes.items()}}


def resolve_layout(spec: LayoutSpec | None, shapes: Shapes, who: str, holds: bool = False
                   ) -> Layout:
    """The layout ``spec`` names for tensors of ``shapes``; where ``shapes`` hold the
    scales of weights quantized on send, the spec is resolved against the weights and each
    scale tensor's box follows its weight's (an actor rank, ``holds``: the blocks whose
    first element it holds; a worker: every block its box touches; see
    :func:`~weightsync_core.data.shards.quantized.with_scale_boxes`).

    Raises:
        ValueError: naming ``who``, a spec of no known kind, with wrong fields, or whose
            layout does not fit ``shapes``.
    """
    scales = scale_tensors(shapes)
    full, shapes = shapes, {name: shape for name, shape in shapes.items() if name not in scales}
    try:
        if spec is None:
            layout = Layout.whole(shapes)
        elif set(spec) == {"fsdp"}:
            fsdp = dict(spec["fsdp"])
            fused = fsdp.pop("fused_experts", False)
            if not isinstance(fused, bool) or set(fsdp) != {"world_size", "rank"}:
                raise ValueError(f"fsdp has world_size, rank and optionally fused_experts "
                                 f"(a bool), got {spec['fsdp']!r}")
            layout = (fsdp_fused_experts_layout if fused else fsdp_layout)(
                shapes, _integer(fsdp["world_size"], "fsdp world_size"),
                _integer(fsdp["rank"], "fsdp rank"))
        elif set(spec) == {"tensor_parallel"}:
            fields = dict(spec["tensor_parallel"])
            size = _integer(fields.pop("size"), "tensor_parallel size")
            rank = _integer(fields.pop("rank"), "tensor_parallel rank")
            layout = decoder_tensor_parallel_layout(shapes, DecoderShape(**fields), size, rank)
        elif set(spec) == {"moe"}:
            fields = dict(spec["moe"])
            size = _integer(fields.pop("size"), "moe size")
            rank = _integer(fields.pop("rank"), "moe rank")
            expert_parallel = fields.pop("expert_parallel", False)
            if not isinstance(expert_parallel, bool):
                raise ValueError(f"moe expert_parallel must be a bool, got {expert_parallel!r}")
            layout = moe_layout(shapes, MoEShape.from_fields(fields), size, rank,
                                expert_parallel)
        elif set(spec) == {"boxes"}:
            layout = Layout({name: Box(tuple((_integer(a, f"boxes {name!r} start"),
                                              _integer(b, f"boxes {name!r} stop"))
                                             for a, b in ranges))
                             for name, ranges in spec["boxes"].items()})
        else:
            raise ValueError(f"a layout spec has one key of fsdp, tensor_parallel, moe or boxes, "
                             f"got {sorted(spec)}")
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{who}: its layout {spec!r} cannot be used: {exc}") from None
    layout = with_scale_boxes(layout, full, holds)
    layout.check(full, who)
    return layout


def plan_layouts(shapes: Shapes, specs: Sequence[LayoutSpec | None], actor_ranks: int,
                 replica_workers: Sequence[int] | None = None,
                 itemsizes: Mapping[str, int] | None = None, relay: bool = False
                 ) -> TransferPlan:
    """The transfer plan of a sharded sync from every process's declared layout (``specs``:
    the actor ranks', then the rollout workers', as ``prepare()`` returned them), checked
    before any byte moves: every layout resolved against ``shapes`` (the weights actor rank
    0 declared) and fitting them exactly, and each replica's workers
    (``replica_workers``, in rollout-rank order; None where the replicas are not known:
    every worker together) needing every element of every tensor.

    Raises:
        LayoutMismatchError: a layout that cannot be used (a geometry that is not the
            checkpoint's, a box out of range or empty, a tensor the weights do not have),
            naming the process as the manager does, the tensor and the shapes, its
            ``index`` that process (actor ranks first); or a replica whose workers leave
            elements of a tensor to none of them (:func:`check_coverage`).
        ValueError: what :meth:`TransferPlan.build` refuses of the actor ranks' layouts.
    """
    names = SyncLayout(actor_ranks, tuple(replica_workers)) if replica_workers else None
    layouts: list[Layout] = []
    for index, spec in enumerate(specs):
        rank = index if index < actor_ranks else index - actor_ranks
        who = (f"actor rank {rank}" if index < actor_ranks else
               names.rollout_name(rank) if names is not None else f"rollout rank {rank}")
        try:
            layouts.append(resolve_layout(spec, shapes, who, holds=index < actor_ranks))
        except ValueError as exc:
            raise LayoutMismatchError(str(exc), index=index, problem=layout_problem(exc, who)
                                      ) from None
    held, needed = layouts[:actor_ranks], layouts[actor_ranks:]
    if replica_workers is None:
        check_coverage(shapes, needed, None, actor_ranks)
    return TransferPlan.build(shapes, held, needed, itemsizes, relay=relay,
                              replicas=replica_workers)


def _integer(value: Any, field: str) -> int:
    """``value`` if it is an integer (a bool is not: ``True`` is no rank).

    Raises:
        ValueError: naming ``field`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an integer, got {value!r} ({type(value).__name__}); "
                         "declare it as an int, not a float, str or bool")
    return value


def weights_spec(weights: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
                 ) -> dict[str, list[Any]]:
    """Every tensor's full shape and dtype (as it travels), in stream order, as plain data."""
    return {name: [list(shape), str(dtype).removeprefix("torch.")]
            for name, (shape, dtype) in weights.items()}


def parse_weights_spec(spec: Mapping[str, Any]) -> tuple[dict[str, tuple[int, ...]],
                                                         dict[str, torch.dtype]]:
    """The shapes and dtypes of :func:`weights_spec`.

    Raises:
        ValueError: data that is not such a spec.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for name, entry in spec.items():
        try:
            shape, dtype = entry
            shapes[name] = tuple(int(size) for size in shape)
            parsed = parse_dtype(dtype)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"tensor {name!r}: {entry!r} is not [shape, dtype] ({exc})") from None
        if parsed is None:
            raise ValueError(f"tensor {name!r}: no dtype given")
        dtypes[name] = parsed
    return shapes, dtypes
