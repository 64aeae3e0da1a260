"""Imported (through ``custom_backend_module``) by every process of
``weightsync-verl-bench``: registers weightsync's backends in verl, and verl's own NIXL
engine as ``verl_nixl_unpinned``: verl's engine, with the two changes a machine without a
CUDA driver forces. Its CPU buckets are allocated without ``pin_memory`` (pinning needs the
driver), and, in these processes only, ``torch.cuda.synchronize()`` returns at once (verl's
engine calls it after every bucket; without a device there is nothing to wait for)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngineRegistry as VerlRegistry

import weightsync_verl  # noqa: F401 (registers weightsync's backends in verl)
from weightsync_verl.bench import UNPINNED_VERL_NIXL

__all__: list[str] = []


@contextlib.contextmanager
def _unpinned() -> Iterator[None]:
    """``torch.zeros(..., pin_memory=True)`` allocates unpinned memory meanwhile."""
    zeros = torch.zeros

    @functools.wraps(zeros)
    def unpinned(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("pin_memory", None)
        return zeros(*args, **kwargs)

    torch.zeros = unpinned
    try:
        yield
    finally:
        torch.zeros = zeros


def _register_unpinned_verl_nixl() -> None:
    try:
        verl_nixl = VerlRegistry.get("nixl")
    except ValueError as exc:
        raise RuntimeError(
            f"verl's NIXL engine did not import: {exc}. It needs cupy (pip install "
            "cupy-cuda12x) and nixl"
        ) from exc

    class UnpinnedNIXLCheckpointEngine(verl_nixl):
        def prepare(self):
            with _unpinned():
                # verl's registry types the class it returns as the abstract base
                return super().prepare()  # pyright: ignore[reportAbstractUsage]

    # verl's register is a plain function in the class body (no @staticmethod)
    VerlRegistry.register(UNPINNED_VERL_NIXL)(UnpinnedNIXLCheckpointEngine)  # pyright: ignore[reportAttributeAccessIssue]


def _synchronize_nothing(device: Any = None) -> None:
    """``torch.cuda.synchronize`` where no CUDA device exists."""


if not torch.cuda.is_available():
    torch.cuda.synchronize = _synchronize_nothing
_register_unpinned_verl_nixl()
