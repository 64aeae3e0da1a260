"""Ring engine: buckets travel actor rank 0 -> rollout worker 0 -> rollout worker 1 -> ...

This is the shared pipeline of the ``nixl`` and ``mooncake`` backends; a subclass only
supplies its :class:`~weightsync_core.net.transport.PeerTransport` (override point:
:meth:`RingCheckpointEngine.create_transport`).

Each hop writes a bucket one-sidedly into a free slot of the next hop's registered buffers,
then says so on the control channel (:class:`~weightsync_core.net.channel.ControlChannel`). A
rollout worker forwards bucket ``k`` to its downstream neighbour while its own server reads
it, and frees the slot (a credit to its upstream) once both are done; meanwhile bucket
``k+1`` lands in its other slot. With ``B`` buckets and ``n`` rollout workers a sync takes
about ``B + n - 1`` bucket times instead of ``n * B``.

Messages (:mod:`~weightsync_core.engines.ring.messages`: a fixed schema, sealed with the
sync's session key, each tagged with the sync's id so that leftovers of an aborted sync are
ignored): downstream to upstream ``hello`` (transport metadata and slot addresses, at the
start of a sync) and ``credit`` (a slot is free again); upstream to downstream ``bucket``
(slot and :class:`~weightsync_core.data.bucketing.BucketMeta`), ``final`` (the manifest) and
``abort``.
"""

from weightsync_core.engines.ring.engine import RingCheckpointEngine

__all__ = ["RingCheckpointEngine"]
