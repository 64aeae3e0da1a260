"""Layouts and weights as plain data, as processes declare them to the driver in
``prepare()`` (before the driver knows the tensors' shapes): what each spec names, resolved
against the shapes into a :class:`~weightsync_core.shards.layout.Layout`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from weightsync_core.dtypes import parse_dtype
from weightsync_core.shards.box import Box
from weightsync_core.shards.layout import Layout, Shapes, fsdp_layout
from weightsync_core.shards.tensor_parallel import DecoderShape, decoder_tensor_parallel_layout

__all__ = [
    "LayoutSpec",
    "boxes_spec",
    "fsdp_spec",
    "parse_weights_spec",
    "resolve_layout",
    "tensor_parallel_spec",
    "weights_spec",
]

LayoutSpec = Mapping[str, Any]
"""``{"fsdp": {"world_size": W, "rank": r}}``, ``{"tensor_parallel": {"size": S, "rank":
r, <DecoderShape fields>}}`` or ``{"boxes": {name: [[start, stop], ...]}}``; None (no spec):
every tensor whole."""


def fsdp_spec(world_size: int, rank: int) -> dict[str, Any]:
    """What FSDP2 rank ``rank`` of ``world_size`` holds (:func:`fsdp_layout`)."""
    return {"fsdp": {"world_size": world_size, "rank": rank}}


def tensor_parallel_spec(model: DecoderShape, size: int, rank: int) -> dict[str, Any]:
    """What tensor-parallel rank ``rank`` of ``size`` needs of a Qwen2/Llama-family model
    (:func:`decoder_tensor_parallel_layout`)."""
    return {"tensor_parallel": {"size": size, "rank": rank, **vars(model)}}


def boxes_spec(layout: Layout) -> dict[str, Any]:
    """An explicit layout."""
    return {"boxes": {name: [list(r) for r in box.ranges] for name, box in layout.boxes.items()}}


def resolve_layout(spec: LayoutSpec | None, shapes: Shapes, who: str) -> Layout:
    """The layout ``spec`` names for tensors of ``shapes``.

    Raises:
        ValueError: naming ``who``, a spec of no known kind, with wrong fields, or whose
            layout does not fit ``shapes``.
    """
    try:
        if spec is None:
            layout = Layout.whole(shapes)
        elif set(spec) == {"fsdp"}:
            fsdp = spec["fsdp"]
            layout = fsdp_layout(shapes, _integer(fsdp["world_size"], "fsdp world_size"),
                                 _integer(fsdp["rank"], "fsdp rank"))
        elif set(spec) == {"tensor_parallel"}:
            fields = dict(spec["tensor_parallel"])
            size = _integer(fields.pop("size"), "tensor_parallel size")
            rank = _integer(fields.pop("rank"), "tensor_parallel rank")
            layout = decoder_tensor_parallel_layout(shapes, DecoderShape(**fields), size, rank)
        elif set(spec) == {"boxes"}:
            layout = Layout({name: Box(tuple((_integer(a, f"boxes {name!r} start"),
                                              _integer(b, f"boxes {name!r} stop"))
                                             for a, b in ranges))
                             for name, ranges in spec["boxes"].items()})
        else:
            raise ValueError(f"a layout spec has one key of fsdp, tensor_parallel or boxes, "
                             f"got {sorted(spec)}")
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{who}: its layout {spec!r} cannot be used: {exc}") from None
    layout.check(shapes, who)
    return layout


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
