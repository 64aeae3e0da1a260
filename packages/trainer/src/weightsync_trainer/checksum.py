"""A digest of named tensors, to check that two processes hold identical weights."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

__all__ = ["weights_digest"]


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes, independent of iteration order."""
    parts = {}
    for name, tensor in named_tensors:
        data = tensor.detach().cpu().contiguous()
        digest = hashlib.sha256(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        parts[name] = digest.hexdigest()
    total = hashlib.sha256()
    for name in sorted(parts):
        total.update(parts[name].encode())
    return total.hexdigest()
