"""Torch dtypes named in configuration."""

from __future__ import annotations

import torch

__all__ = ["parse_dtype"]


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """Turn ``"bfloat16"`` / ``"torch.bfloat16"`` / a ``torch.dtype`` into a ``torch.dtype``."""
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"rollout_dtype {value!r} is not a torch dtype; use a name such as "
            "'bfloat16', 'float16' or 'float32'"
        )
    return dtype
