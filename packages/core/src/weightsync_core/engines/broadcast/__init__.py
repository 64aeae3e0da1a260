"""Collective-broadcast engine: actor rank 0 broadcasts each bucket to all rollout workers.

This is the shared pipeline of the ``gloo``, ``nccl`` and ``hccl`` backends. A subclass
overrides only what its hardware needs, through these public override points:

- :attr:`device_type`, :meth:`current_device` and :meth:`allocate_bucket`: where buckets
  live;
- :meth:`new_data_group`: the communicator that moves bucket bytes;
- :meth:`synchronize_device`: stream handling before a bucket is sent or read.

Modules: :mod:`.engine` (the engine), :mod:`.group` (port reservation, rendezvous, reuse),
:mod:`.protocol` (the wire protocol) and :mod:`.relay` (the relay API kimi feeds).

Control messages (bucket metadata, the final manifest, aborts) always travel on a small gloo
group over host memory. Each bucket is one message: a 2-integer header ``[meta_len,
data_len]``, the metadata (a fixed schema sealed with the sync's session key, see
:mod:`weightsync_core.net.wire`; receivers check the seal before decoding), then the bucket bytes
on the data group. The sender fills bucket ``k+1`` while bucket ``k`` is on the wire;
receivers post the receive of ``k+1`` before unpacking ``k``.

The group's rendezvous store listens on the configured host only, and every key lives under
a prefix derived from the session key: a process outside the sync can neither read the
members' addresses nor claim a rank.
"""

from weightsync_core.engines.broadcast.engine import CollectiveBroadcastCheckpointEngine
from weightsync_core.engines.broadcast.group import Collective

__all__ = ["Collective", "CollectiveBroadcastCheckpointEngine"]
