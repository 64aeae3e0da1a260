"""Delta sync: after a full sync, send per tensor only what differs bitwise from the
version every receiver holds, and check each rebuilt tensor whole (see ``docs/delta.md``)."""

from weightsync_core.data.delta.codec import (
    DeltaBaselineError,
    DeltaPlan,
    DeltaReceiver,
    DeltaSender,
    DeltaStats,
    ShareDecoder,
    ShareEncoder,
)
from weightsync_core.data.delta.patch import (
    PATCH_HEADER_BYTES,
    PatchDigestError,
    PatchKind,
    PatchStats,
    apply_patch,
    encode_patch,
    tensor_digest,
)
from weightsync_core.data.delta.spread import SpreadDeltaSender

__all__ = [
    "PATCH_HEADER_BYTES",
    "DeltaBaselineError",
    "DeltaPlan",
    "DeltaReceiver",
    "DeltaSender",
    "DeltaStats",
    "PatchDigestError",
    "PatchKind",
    "PatchStats",
    "ShareDecoder",
    "ShareEncoder",
    "SpreadDeltaSender",
    "apply_patch",
    "encode_patch",
    "tensor_digest",
]
