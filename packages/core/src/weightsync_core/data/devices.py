"""Where bucket buffers live: host memory or an accelerator (``cuda``, ``npu``)."""

from __future__ import annotations

import torch

from weightsync_core.api.errors import WeightSyncError

__all__ = ["allocate_bucket", "resolve_device", "synchronize_device"]


def resolve_device(device_type: str, engine: str, cpu_alternative: str) -> torch.device:
    """The device of type ``device_type`` this process uses now; fails, with the fix, when
    none is visible. ``engine`` and ``cpu_alternative`` name the engine and what to use on
    hosts without that device."""
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type, None)
    if module is None or not module.is_available():
        raise WeightSyncError(
            f"{engine} needs a {device_type} device, but torch.{device_type}.is_available() "
            "is False in this process (no device, or the *_VISIBLE_DEVICES variable hides it)."
            f" On CPU-only hosts use {cpu_alternative}."
        )
    return torch.device(device_type, module.current_device())


def allocate_bucket(nbytes: int, device: torch.device, mapped: bool = True) -> torch.Tensor:
    """One ``uint8`` bucket buffer on ``device``. Host buffers are zero-filled (``mapped``)
    so that the pages of a buffer kept for many syncs are mapped now rather than during the
    first transfer; a buffer that the next write fills whole (a receiver's copy of one
    bucket) need not be."""
    if device.type == "cpu" and mapped:
        return torch.zeros(nbytes, dtype=torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def synchronize_device(device: torch.device) -> None:
    """Block until ``device``'s current stream is idle (no-op on host memory)."""
    if device.type != "cpu":
        torch.get_device_module(device.type).current_stream(device).synchronize()
