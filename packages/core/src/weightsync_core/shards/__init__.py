"""Sharded delivery: layouts (what each actor rank holds and each rollout worker needs, a
box per checkpoint tensor), the transfer plan built from them, and its exchange over a gloo
group (see the core README, "Sharded delivery")."""

from weightsync_core.shards.box import Box
from weightsync_core.shards.exchange import PlanExchange, PointToPoint
from weightsync_core.shards.layout import Layout, Shapes, fsdp_layout
from weightsync_core.shards.specs import (
    LayoutSpec,
    boxes_spec,
    fsdp_spec,
    parse_weights_spec,
    resolve_layout,
    tensor_parallel_spec,
    weights_spec,
)
from weightsync_core.shards.tensor_parallel import DecoderShape, decoder_tensor_parallel_layout
from weightsync_core.shards.transfers import Transfer, TransferPlan

__all__ = [
    "Box",
    "DecoderShape",
    "Layout",
    "LayoutSpec",
    "PlanExchange",
    "PointToPoint",
    "Shapes",
    "Transfer",
    "TransferPlan",
    "boxes_spec",
    "decoder_tensor_parallel_layout",
    "fsdp_layout",
    "fsdp_spec",
    "parse_weights_spec",
    "resolve_layout",
    "tensor_parallel_spec",
    "weights_spec",
]
