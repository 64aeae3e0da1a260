"""The one-sided transport interface of peer-to-peer engines (NIXL, Mooncake, kimi).

A :class:`PeerTransport` registers local buffers, connects to peers by the metadata they
publish, and writes (or reads) a local registered tensor into (from) a peer's registered
buffer. Every method blocks; engines call them on worker threads
(:func:`~weightsync_core.net.blocking.run_blocking`). A failed transfer raises
:class:`~weightsync_core.api.errors.TransferError` carrying the library's status ``code``; the
engine adds which peer and stage it was.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PeerTransport", "RemoteBuffer", "describe_buffer"]


@dataclass(frozen=True)
class RemoteBuffer:
    """A registered buffer as a peer addresses it.

    Attributes:
        addr: start address in the owner's address space.
        nbytes: size in bytes.
        device: ``"cpu"`` or ``"cuda"`` (where the memory lives).
        device_id: the device index (0 for host memory).
    """

    addr: int
    nbytes: int
    device: str = "cpu"
    device_id: int = 0

    def at(self, offset: int, nbytes: int) -> RemoteBuffer:
        """The ``nbytes`` bytes starting ``offset`` bytes into this buffer."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"bytes [{offset}, {offset + nbytes}) lie outside a {self.nbytes}-byte buffer"
            )
        return RemoteBuffer(self.addr + offset, nbytes, self.device, self.device_id)


def describe_buffer(buffer: torch.Tensor) -> RemoteBuffer:
    """How a peer addresses the bytes of the contiguous tensor ``buffer``."""
    if not buffer.is_contiguous():
        raise ValueError("only contiguous tensors can be registered for transfers")
    device = buffer.device
    return RemoteBuffer(
        buffer.data_ptr(), buffer.numel() * buffer.element_size(), device.type,
        device.index or 0,
    )


class PeerTransport(ABC):
    """One process's endpoint of a one-sided transfer library."""

    @abstractmethod
    def register(self, buffer: torch.Tensor) -> RemoteBuffer:
        """Register ``buffer`` (contiguous) for transfers; returns how peers address it."""

    @abstractmethod
    def deregister(self, buffer: torch.Tensor) -> None:
        """Undo :meth:`register` for ``buffer``."""

    @abstractmethod
    def metadata(self) -> Any:
        """What a peer passes to :meth:`connect` to reach this process (picklable; call it
        after registering, since some libraries publish registrations through it)."""

    @abstractmethod
    def connect(self, metadata: Any) -> Hashable:
        """Make the peer described by ``metadata`` reachable; returns its handle. Idempotent
        for unchanged metadata."""

    @abstractmethod
    def disconnect(self, peer: Hashable) -> None:
        """Forget a peer returned by :meth:`connect`."""

    @abstractmethod
    def write(
        self, peer: Hashable, local: torch.Tensor, remote: RemoteBuffer, timeout: float
    ) -> None:
        """Copy the registered contiguous tensor ``local`` into ``remote`` on ``peer``;
        returns when the bytes have landed."""

    @abstractmethod
    def read(
        self, peer: Hashable, local: torch.Tensor, remote: RemoteBuffer, timeout: float
    ) -> None:
        """Copy ``remote`` on ``peer`` into the registered contiguous tensor ``local``."""

    @abstractmethod
    def close(self) -> None:
        """Release everything this transport holds (idempotent)."""
