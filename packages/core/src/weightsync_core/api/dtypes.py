"""Torch dtypes named in configuration."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ROLLOUT_DTYPES", "decode_hook", "encode_hook", "parse_dtype", "parse_rollout_dtype"]

ROLLOUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The dtypes a ``rollout_dtype`` may cast to: the floating dtypes an inference replica
serves a model in (vLLM's ``bfloat16``, ``float16``, ``float32``). An integer, bool or
complex dtype would change the values themselves, float8 needs scales a plain cast does not
make, and float64 only doubles the bytes of float32 weights."""


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


def parse_rollout_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """:func:`parse_dtype` for a ``rollout_dtype``: one of :data:`ROLLOUT_DTYPES`, or None.

    Raises:
        ValueError: no torch dtype, or one no replica serves weights in, naming the dtypes
            accepted.
    """
    dtype = parse_dtype(value)
    if dtype is not None and dtype not in ROLLOUT_DTYPES:
        accepted = ", ".join(repr(str(d).removeprefix("torch.")) for d in ROLLOUT_DTYPES)
        raise ValueError(
            f"rollout_dtype {value!r} cannot be a rollout dtype: floating-point weights are "
            f"cast to it before they travel, and a replica serves only {accepted}; set "
            "rollout_dtype to one of those (or leave it unset to keep each tensor's dtype)"
        )
    return dtype


_DTYPES: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
}
"""Every dtype torch defines, by name: the only dtypes a message can name."""


def decode_hook(kind: type, value: Any) -> Any:
    """msgspec's ``dec_hook`` for what control messages carry beyond MessagePack's types
    (a torch dtype, by its name; :func:`~weightsync_core.convert` also meets the dtype
    itself)."""
    if kind is torch.dtype:
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and value in _DTYPES:
            return _DTYPES[value]
        raise ValueError(f"{value!r} is not a torch dtype")
    raise NotImplementedError(f"no decoder for {kind!r}")


def encode_hook(value: Any) -> Any:
    """msgspec's ``enc_hook`` for :func:`decode_hook`'s types: a torch dtype by its name."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    raise NotImplementedError(f"cannot send a {type(value).__name__} in a control message")
