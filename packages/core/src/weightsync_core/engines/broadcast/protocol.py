"""The broadcast engine's wire protocol. Each message is a 2-integer header ``[meta_len,
data_len]`` and its metadata (a fixed schema sealed with the sync's session key, see
:mod:`weightsync_core.net.wire`; receivers check the seal before decoding) on the gloo control
group, then the bucket bytes, if any, on the data group."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BroadcastOptions

from weightsync_core.api.errors import (
    MalformedMessageError,
    TransferError,
    UnauthenticatedMessageError,
)
from weightsync_core.data.bucketing import BucketMeta
from weightsync_core.data.verification import ManifestEntry
from weightsync_core.engines.broadcast.group import BroadcastGroup, Collective
from weightsync_core.net.wire import MessageCodec

__all__ = [
    "AbortMessage",
    "BroadcastMessage",
    "BucketMessage",
    "FinalMessage",
    "Posted",
    "open_message",
    "post_message",
    "receive_message",
]

MAX_METADATA_BYTES = 1 << 30
"""The largest metadata frame a receiver accepts."""


class BucketMessage(msgspec.Struct, tag="bucket", frozen=True):
    """A bucket follows on the data group; ``meta`` describes it."""

    meta: BucketMeta


class FinalMessage(msgspec.Struct, tag="final", frozen=True):
    """Every bucket was sent; ``manifest`` lists what they held."""

    manifest: list[ManifestEntry]
    global_steps: int | None


class AbortMessage(msgspec.Struct, tag="abort", frozen=True):
    """The sync is off, because of ``reason``."""

    reason: str


BroadcastMessage = BucketMessage | FinalMessage | AbortMessage
"""Every message of the protocol."""
_CODEC: MessageCodec[BroadcastMessage] = MessageCodec(BroadcastMessage)

Posted = list[tuple[dist.Work, str]]
"""Posted broadcasts, each with the stage it moves (for errors)."""


def post(group: Collective, tensor: torch.Tensor) -> dist.Work:
    """Enqueue one broadcast from group rank 0 (returns at once)."""
    options = BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def post_message(
    group: BroadcastGroup, message: BroadcastMessage, data: torch.Tensor | None = None
) -> Posted:
    """Enqueue header, sealed metadata and bucket bytes of one message, in that order."""
    sealed = group.sealer.seal(_CODEC.encode(message))
    meta = torch.frombuffer(bytearray(sealed), dtype=torch.uint8)
    data_len = 0 if data is None else data.numel()
    header = torch.tensor([meta.numel(), data_len], dtype=torch.int64)
    name = type(message).__name__.removesuffix("Message").lower()
    works = [
        (post(group.control, header), f"{name} header"),
        (post(group.control, meta), f"{name} metadata"),
    ]
    if data is not None and data_len:
        works.append((post(group.data, data), "bucket data"))
    return works


def receive_message(
    group: BroadcastGroup, buffer: Callable[[int], torch.Tensor], bucket_size: int,
    wait: Callable[[BroadcastGroup, Posted], None], rank: int | None,
) -> tuple[BroadcastMessage, torch.Tensor]:
    """Receive one message (blocking: header, then the rest), its bytes into
    ``buffer(nbytes)``, a buffer of at least the ``nbytes`` the header announces (at most
    ``bucket_size``); ``wait`` completes posted broadcasts, ``rank`` names this receiver in
    errors."""
    header = torch.zeros(2, dtype=torch.int64)
    wait(group, [(post(group.control, header), "header")])
    meta_len, data_len = (int(value) for value in header)
    if not 0 < meta_len <= MAX_METADATA_BYTES:
        raise TransferError(
            f"rollout rank {rank} received a malformed message header {header.tolist()}"
            f" from {group.sender}; the group is out of step (a peer from another sync?)",
            peer=group.sender, stage="header",
        )
    if data_len > bucket_size or data_len < 0:
        raise TransferError(
            f"{group.sender} announced a {data_len}-byte bucket but rollout rank "
            f"{rank} has {bucket_size}-byte buckets; use the same "
            "update_weights_bucket_megabytes on both sides",
            peer=group.sender, stage="header",
        )
    meta = torch.empty(meta_len, dtype=torch.uint8)
    data = buffer(data_len)[:data_len]
    works = [(post(group.control, meta), "metadata")]
    if data_len:
        works.append((post(group.data, data), "bucket data"))
    wait(group, works)
    return open_message(group, meta.numpy().tobytes(), data, rank), data


def open_message(
    group: BroadcastGroup, frame: bytes, data: torch.Tensor, rank: int | None
) -> BroadcastMessage:
    """The message in ``frame``, once its seal and its fit with ``data`` check out."""
    try:
        message = _CODEC.decode(group.sealer.open(frame))
        if isinstance(message, BucketMessage):
            message.meta.check(data.numel())
            if message.meta.nbytes != data.numel():
                raise ValueError(
                    f"bucket {message.meta.index} describes {message.meta.nbytes} bytes "
                    f"but {data.numel()} arrived"
                )
    except (UnauthenticatedMessageError, MalformedMessageError, ValueError) as exc:
        raise TransferError(
            f"rollout rank {rank} refused a message from {group.sender}: {exc}",
            peer=group.sender, stage="metadata",
        ) from exc
    return message
