"""Sharded delivery: layouts (what each actor rank holds and each rollout worker needs, a
box per checkpoint tensor, dense or mixture-of-experts), the transfer plan built from them,
and its exchange over a gloo group, its bytes as gloo messages or written one-sidedly
through a transport (see ``docs/sharded.md``)."""

from weightsync_core.data.shards.box import Box
from weightsync_core.data.shards.exchange import (
    PieceCarrier,
    PlanExchange,
    PlanSender,
    PointToPoint,
)
from weightsync_core.data.shards.experts import (
    MoEShape,
    experts_of_rank,
    fsdp_first_expert,
    fsdp_fused_experts_layout,
    fused_experts,
    moe_layout,
    per_expert_shapes,
    per_expert_stream,
)
from weightsync_core.data.shards.layout import (
    Layout,
    LayoutMismatchError,
    Shapes,
    check_coverage,
    fsdp_layout,
)
from weightsync_core.data.shards.one_sided import (
    KnownReceivers,
    Landing,
    OneSidedCarrier,
    RegisteredBuffer,
)
from weightsync_core.data.shards.patches import SliceDecoder, SliceEncoder
from weightsync_core.data.shards.pieces import (
    PieceDecoder,
    PieceEncoder,
    WholePieces,
    piece_capacity,
)
from weightsync_core.data.shards.specs import (
    LayoutSpec,
    boxes_spec,
    fsdp_spec,
    moe_spec,
    parse_weights_spec,
    plan_layouts,
    resolve_layout,
    tensor_parallel_spec,
    weights_spec,
)
from weightsync_core.data.shards.tensor_parallel import DecoderShape, decoder_tensor_parallel_layout
from weightsync_core.data.shards.transfers import Transfer, TransferPlan

__all__ = [
    "Box",
    "DecoderShape",
    "KnownReceivers",
    "Landing",
    "Layout",
    "LayoutMismatchError",
    "LayoutSpec",
    "MoEShape",
    "OneSidedCarrier",
    "PieceCarrier",
    "PieceDecoder",
    "PieceEncoder",
    "PlanExchange",
    "PlanSender",
    "PointToPoint",
    "RegisteredBuffer",
    "Shapes",
    "SliceDecoder",
    "SliceEncoder",
    "Transfer",
    "TransferPlan",
    "WholePieces",
    "boxes_spec",
    "check_coverage",
    "decoder_tensor_parallel_layout",
    "experts_of_rank",
    "fsdp_first_expert",
    "fsdp_fused_experts_layout",
    "fsdp_layout",
    "fsdp_spec",
    "fused_experts",
    "moe_layout",
    "moe_spec",
    "parse_weights_spec",
    "per_expert_shapes",
    "per_expert_stream",
    "piece_capacity",
    "plan_layouts",
    "resolve_layout",
    "tensor_parallel_spec",
    "weights_spec",
]
