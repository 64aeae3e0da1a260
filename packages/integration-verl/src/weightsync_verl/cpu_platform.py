"""A CPU platform for verl, which registers none (verl 0.9.1 knows ``nvidia``, ``huawei``
and ``amd``, and falls back to CUDA without them).

Importing this module registers platform ``cpu`` in verl's ``PlatformRegistry``; a process
selects it with ``VERL_PLATFORM=cpu`` and imports it before verl resolves its platform
with ``VERL_USE_EXTERNAL_MODULES=weightsync_verl.cpu_platform`` (see
:data:`weightsync_verl.actor_group.CPU_WORKER_ENV`). Device calls verl makes that CPU
has no counterpart of (cache and memory statistics, profiler ranges) do nothing; the
collective backend is gloo. It lets verl's own workers (FSDP2 included) start on a
machine without accelerators, for tests.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

__all__ = ["PLATFORM", "PlatformCPU"]

PLATFORM = "cpu"
"""The platform's name (``VERL_PLATFORM``)."""


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


def _no_bytes(*_args: Any, **_kwargs: Any) -> int:
    return 0


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` as verl's device module (``torch.cuda``'s place): what ``torch.cpu``
    lacks reports no memory (``memory_*``: 0 bytes, ``mem_get_info``: ``(0, 0)``) or does
    nothing."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name == "mem_get_info":
            return lambda *_args, **_kwargs: (0, 0)
        if name.startswith(("memory_", "max_memory_")):
            return _no_bytes
        return _nothing


_DEVICE_MODULE = _CpuDeviceModule("weightsync_verl.cpu_platform.device")


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """verl's platform interface on the CPU."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    # verl uses the index as a device (``module.to_empty(device=get_device_id())``): an int
    # would mean cuda:<index>, so the CPU's "index" is the device itself
    def current_device(self) -> Any:  # pyright: ignore[reportIncompatibleMethodOverride]
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        """One device: nothing to select."""

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU work is synchronous."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """The CPU allocator takes no settings."""

    def empty_cache(self) -> None:
        """The CPU allocator keeps no cache to empty."""

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    # verl's base declares it a context manager (@contextmanager over the abstract method)
    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:  # pyright: ignore[reportIncompatibleMethodOverride]
        yield

    def profiler_start(self) -> None:
        """No device profiler."""

    def profiler_stop(self) -> None:
        """No device profiler."""

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None
