"""Mooncake Transfer Engine as a :class:`~weightsync_core.net.transport.PeerTransport`.

Peers find each other without a metadata server (``P2PHANDSHAKE``): a peer's address is its
session id ``host:rpc_port``, and the engine fetches the peer's segment description on first
use.

Mooncake (0.3.x) binds its two listeners, the handshake (RPC) port and the TCP transport's
data port, to every interface whatever ``host`` says, and offers no setting to change that;
see the threat model in the docs (``docs/security.md``) for what that exposes and how weightsync
detects tampering. :meth:`MooncakeTransport.close` closes both.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

import torch

from weightsync_core.spi import (
    PeerTransport,
    RemoteBuffer,
    TransferError,
    WeightSyncError,
    describe_buffer,
)

try:
    from mooncake.engine import TransferEngine
except ImportError as exc:  # the registry shows this message as the backend's load error
    raise ImportError(
        f"weightsync-mooncake could not load Mooncake Transfer Engine ({exc}). Install one "
        "build: pip install 'weightsync-mooncake[non-cuda]' on CPU-only hosts (needs the system "
        "libraries libibverbs1, librdmacm1 and libnuma1: apt-get install libibverbs1 librdmacm1 "
        "libnuma1), 'weightsync-mooncake[cuda12]' or 'weightsync-mooncake[cuda13]' on GPU hosts"
    ) from exc

__all__ = ["MooncakeTransport"]

_BIND_ATTEMPTS = 3
"""Transfer Engines started before giving up when the listening port each picks at random
is already taken (it picks another each time)."""


def _initialized_engine(host: str, protocol: str, device_name: str
                        ) -> tuple[TransferEngine, int]:
    """A Transfer Engine initialised for peer-to-peer handshakes, and the code
    ``initialize`` returned. Mooncake chooses its listening ports at random and raises
    ``RuntimeError("bind: Address already in use")`` where one is taken (seen once in a
    CI run of about a hundred engines): a fresh engine then tries other ports."""
    attempts_left = _BIND_ATTEMPTS
    while True:
        engine = TransferEngine()
        try:
            return engine, engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        except RuntimeError as exc:
            attempts_left -= 1
            if "Address already in use" not in str(exc) or not attempts_left:
                raise


_FIRST_POLL_SECONDS = 20e-6
_MAX_POLL_SECONDS = 2e-3
_DONE, _IN_PROGRESS = 1, 0


class MooncakeTransport(PeerTransport):
    """One Transfer Engine per process, initialised for peer-to-peer handshakes.

    Args:
        host: the address peers reach this process at.
        protocol: ``"tcp"``, ``"rdma"``, ``"efa"``, ``"ascend_direct"``, ...
        device_name: comma-separated NIC names for RDMA (``"mlx5_0,mlx5_1"``); empty lets
            the engine discover them.
    """

    def __init__(self, host: str, protocol: str = "tcp", device_name: str = "") -> None:
        engine, code = _initialized_engine(host, protocol, device_name)
        self._engine: TransferEngine | None = engine
        if code != 0:
            raise WeightSyncError(
                f"Mooncake Transfer Engine failed to start on {host} with protocol "
                f"{protocol!r} and devices {device_name!r} (code {code}); check that the "
                "protocol is supported here (tcp works everywhere) and the device names exist"
            )
        self.session_id = f"{host}:{engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}

    def _require_engine(self) -> TransferEngine:
        """The Transfer Engine (until :meth:`close`).

        Raises:
            WeightSyncError: the transport was closed.
        """
        if self._engine is None:
            raise WeightSyncError(f"the Mooncake transport at {self.session_id} is closed")
        return self._engine

    def register(self, buffer: torch.Tensor) -> RemoteBuffer:
        descriptor = describe_buffer(buffer)
        code = self._require_engine().register_memory(descriptor.addr, descriptor.nbytes)
        if code != 0:
            raise TransferError(
                f"Mooncake could not register {descriptor.nbytes} bytes at "
                f"{descriptor.addr:#x} (code {code})", stage="register", code=code,
            )
        self._registered[descriptor.addr] = descriptor.nbytes
        return descriptor

    def deregister(self, buffer: torch.Tensor) -> None:
        if self._registered.pop(buffer.data_ptr(), None) is not None:
            self._require_engine().unregister_memory(buffer.data_ptr())

    def metadata(self) -> str:
        return self.session_id

    def connect(self, metadata: str) -> Hashable:
        return metadata  # the engine opens the peer's segment on first transfer

    def disconnect(self, peer: Hashable) -> None:
        """Nothing to release: the engine keeps no per-peer state we can drop."""

    def write(
        self, peer: Hashable, local: torch.Tensor, remote: RemoteBuffer, timeout: float
    ) -> None:
        nbytes = self._check(local, remote)
        if nbytes == 0:
            return
        engine = self._require_engine()
        batch = engine.transfer_submit_write(
            str(peer), local.data_ptr(), remote.addr, nbytes
        )
        if batch < 0:
            raise TransferError(
                f"Mooncake refused a {nbytes}-byte write to {peer} (code {batch})",
                code=batch,
            )
        deadline = time.monotonic() + timeout
        pause = _FIRST_POLL_SECONDS
        while (status := engine.transfer_check_status(batch)) == _IN_PROGRESS:
            if time.monotonic() > deadline:
                raise TransferError(
                    f"Mooncake write of {nbytes} bytes to {peer} still in progress after "
                    f"{timeout:.0f}s", code=status,
                )
            time.sleep(pause)
            pause = min(pause * 2, _MAX_POLL_SECONDS)
        if status != _DONE:
            raise TransferError(
                f"Mooncake write of {nbytes} bytes to {peer} failed with status {status} "
                "(-1: failed, -2: timed out; is the peer alive and its memory registered?)",
                code=status,
            )

    def read(
        self, peer: Hashable, local: torch.Tensor, remote: RemoteBuffer, timeout: float
    ) -> None:
        """Blocking read (bounded by Mooncake's ``MC_TRANSFER_TIMEOUT``, and by the engine's
        own wait around this call)."""
        nbytes = self._check(local, remote)
        if nbytes == 0:
            return
        engine = self._require_engine()
        code = engine.transfer_sync_read(str(peer), local.data_ptr(), remote.addr, nbytes)
        if code != 0:
            raise TransferError(
                f"Mooncake read of {nbytes} bytes from {peer} failed with code {code}",
                code=code,
            )

    @staticmethod
    def _check(local: torch.Tensor, remote: RemoteBuffer) -> int:
        nbytes = local.numel() * local.element_size()
        if nbytes != remote.nbytes:
            raise ValueError(f"local tensor has {nbytes} bytes, remote buffer {remote.nbytes}")
        return nbytes

    def close(self) -> None:
        """Unregister every buffer and drop the engine: its destructor closes both of its
        listeners (Mooncake has no explicit shutdown). Idempotent."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        for addr in list(self._registered):
            engine.unregister_memory(addr)
        self._registered.clear()
        del engine
