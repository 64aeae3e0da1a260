"""Sharded delivery by one-sided writes: the base of ``nixl_sharded`` and
``mooncake_sharded``. The plan, its agreement and the sealed checksums are
``gloo_sharded``'s; the pieces' bytes are written by every actor rank straight into the
rollout workers' registered landing buffers through a backend's
:class:`~weightsync_core.net.transport.PeerTransport`."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

from weightsync_core.data.devices import resolve_device
from weightsync_core.data.shards.exchange import PlanExchange
from weightsync_core.data.shards.one_sided import KnownReceivers, OneSidedCarrier, RegisteredBuffer
from weightsync_core.engines.sharded_gloo import ShardedGlooCheckpointEngine, ShardedGlooOptions
from weightsync_core.net.transport import PeerTransport

__all__ = ["ShardedTransportEngine", "ShardedTransportOptions"]


@dataclass(frozen=True)
class ShardedTransportOptions(ShardedGlooOptions):
    """Options of the one-sided sharded engines: ``gloo_sharded``'s (``host``,
    ``chunk_megabytes``: here the largest single write, the size of each sender's staging
    buffer; ``group_init_timeout``) and where the registered buffers live.

    Attributes:
        device: ``"cpu"`` (host memory) or ``"cuda"``: where each worker's landing buffer
            and each sender's staging buffer are allocated and registered.
    """

    device: Literal["cpu", "cuda"] = "cpu"


class ShardedTransportEngine(ShardedGlooCheckpointEngine):
    """Sharded delivery with the bytes written one-sidedly (override point:
    :meth:`create_transport`).

    Each sync, after every process agreed on the plan, each rollout worker hands its
    senders, sealed, the address of its registered landing buffer, which holds exactly the
    pieces it receives; every actor rank then writes each piece it sends into place
    (through a registered staging buffer of ``chunk_megabytes``), all senders at once, and
    sends the piece's sealed checksum once the bytes have landed; the worker copies the
    piece out of registered memory and checks it before placing it. The transport, the
    buffers (scrubbed after every sync) and the senders' connections stay for the next
    sync, which registers and connects nothing unless the plan grew a worker's landing; a
    failed sync drops them all.
    """

    options_class = ShardedTransportOptions
    options: ShardedTransportOptions  # pyright: ignore[reportIncompatibleVariableOverride]  # built from options_class

    def __init__(self, bucket_size: int, **kwargs: Any) -> None:
        super().__init__(bucket_size, **kwargs)
        self.device = resolve_device(self.options.device, type(self).__name__, "device='cpu'")
        self._transport: PeerTransport | None = None
        self._buffer = RegisteredBuffer(lambda: self.transport, self.device)
        """A worker's landing buffer or a sender's staging buffer."""
        self._receivers = KnownReceivers(lambda: self.transport)

    @abstractmethod
    def create_transport(self) -> PeerTransport:
        """Override point: this process's transport endpoint (called once, at the first
        sync; a backend returns its :class:`~weightsync_core.net.transport.PeerTransport`)."""

    @property
    def transport(self) -> PeerTransport:
        """This process's transport endpoint (created on first use)."""
        if self._transport is None:
            self._transport = self.create_transport()
        return self._transport

    def carry(self, exchange: PlanExchange, group_rank: int) -> None:
        """Hand out the landing buffers and write the pieces through the transport."""
        OneSidedCarrier.connect(exchange, self.transport, group_rank, self._buffer,
                                self._receivers)

    def finalize(self) -> None:
        """End this sync: scrub the registered buffer; it and the transport stay."""
        self._buffer.scrub()
        super().finalize()

    def abort(self) -> None:
        """After a failed sync anywhere: deregister the buffer (a write left over from the
        failed sync can land nowhere) and disconnect every worker."""
        self._buffer.release()
        self._receivers.forget_all()
        super().abort()

    def close(self) -> None:
        """Release everything, the transport included (it is created again if needed)."""
        self.abort()
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()
