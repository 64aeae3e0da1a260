"""The ring engine's control messages: a fixed schema, sealed with the sync's key on the wire
(see :mod:`weightsync_core.net.wire`). Every message names its sync, so leftovers of an aborted
sync are ignored."""

from __future__ import annotations

from typing import Any

import msgspec

from weightsync_core.data.bucketing import BucketMeta
from weightsync_core.data.verification import ManifestEntry
from weightsync_core.net.transport import RemoteBuffer

__all__ = ["Abort", "BucketReady", "Credit", "Final", "Hello", "RingMessage"]


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """Downstream to upstream, at the start of a sync: how to reach its slots."""

    sync: str
    peer: Any
    """The downstream's transport metadata."""
    slots: list[RemoteBuffer]


class Credit(msgspec.Struct, tag="credit", frozen=True):
    """Downstream to upstream: ``slot`` is free again."""

    sync: str
    slot: int


class BucketReady(msgspec.Struct, tag="bucket", frozen=True):
    """Upstream to downstream: bucket ``meta`` was written into ``slot``."""

    sync: str
    slot: int
    meta: BucketMeta


class Final(msgspec.Struct, tag="final", frozen=True):
    """Upstream to downstream: every bucket was sent; ``manifest`` lists what they held."""

    sync: str
    manifest: list[ManifestEntry]
    global_steps: int | None


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """Upstream to downstream: the sync is off, because of ``reason``."""

    sync: str
    reason: str


RingMessage = Hello | Credit | BucketReady | Final | Abort
"""Every message a ring inbox accepts."""
