"""Delta sync's sweeps over host memory, compiled (numba): one pass over a tensor's old and
new bytes finds the changed elements, gathers their new values and updates the old copy;
one pass over a patch's positions checks them and writes the values.

Each works on host tensors whose bytes it can read as aligned 8-byte words (any element
width of 1, 2, 4 or 8 bytes); for anything else (device tensors, odd offsets) the callers
use torch's operators, which give the same result in several passes. Compiled code is cached
next to this module (``cache=True``): a process pays the compile (about 1 s) only where no
cache is there yet, and numba's import (0.3 s) only at its first sweep.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["diff_gather", "scatter_checked"]

_WORD_BYTES = 8
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_POSITIONS = {torch.int32: np.int32, torch.int64: np.int64}


def _diff_words(new: np.ndarray, old: np.ndarray, lanes: int, positions: np.ndarray,
                values: np.ndarray) -> int:
    """Compare ``new`` and ``old`` (uint64 words of ``lanes`` elements each) word by word;
    for each element that differs, write its flat position and new value; copy each
    changed word into ``old``. Returns how many elements changed."""
    bits = np.uint64(64 // lanes)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) if lanes == 1 else (np.uint64(1) << bits) - np.uint64(1)
    found = 0
    for word in range(new.shape[0]):
        now = new[word]
        was = old[word]
        if now != was:
            differs = now ^ was
            for lane in range(lanes):
                shift = np.uint64(lane) * bits
                if (differs >> shift) & mask:
                    positions[found] = word * lanes + lane
                    values[found] = (now >> shift) & mask
                    found += 1
            old[word] = now
    return found


def _diff_elements(new: np.ndarray, old: np.ndarray, offset: int, positions: np.ndarray,
                   values: np.ndarray, found: int) -> int:
    """The same as :func:`_diff_words` for elements one by one (a tail shorter than a
    word), numbered from ``offset``, appending after the ``found`` already written."""
    for index in range(new.shape[0]):
        if new[index] != old[index]:
            positions[found] = offset + index
            values[found] = new[index]
            old[index] = new[index]
            found += 1
    return found


def _scatter(target: np.ndarray, positions: np.ndarray,
             values: np.ndarray) -> int:
    """Write ``values`` at ``positions`` of ``target`` once every position is checked to
    lie inside it; returns the index of the first position outside (nothing written), or
    -1."""
    size = target.shape[0]
    for index in range(positions.shape[0]):
        if positions[index] < 0 or positions[index] >= size:
            return index
    for index in range(positions.shape[0]):
        target[positions[index]] = values[index]
    return -1


class _Compiled(NamedTuple):
    diff_words: Callable[..., Any]
    diff_elements: Callable[..., Any]
    scatter: Callable[..., Any]


@functools.cache
def _compiled() -> _Compiled:
    """The sweeps, compiled (or loaded from numba's cache) at their first use."""
    import numba  # here: a process that never sweeps never pays its import

    def compile_(function: Callable[..., Any]) -> Callable[..., Any]:
        try:
            return numba.njit(nogil=True, cache=True)(function)
        except RuntimeError:  # no writable cache directory: compiled in this process only
            return numba.njit(nogil=True)(function)
    return _Compiled(compile_(_diff_words), compile_(_diff_elements), compile_(_scatter))


def _unsigned(tensor: torch.Tensor) -> np.ndarray | None:
    """A flat contiguous host tensor's elements as a numpy array of unsigned integers of
    their width (a view), or None where that is not possible."""
    width = tensor.element_size()
    if tensor.device.type != "cpu" or width not in _UNSIGNED or not tensor.is_contiguous():
        return None
    return tensor.view(torch.uint8).numpy().view(_UNSIGNED[width])


def _words(elements: np.ndarray, count: int) -> np.ndarray | None:
    """The first ``count`` elements of ``elements`` as aligned uint64 words, or None."""
    body = elements[:count]
    if body.ctypes.data % _WORD_BYTES:
        return None
    return body.view(np.uint64)


def diff_gather(new: torch.Tensor, old: torch.Tensor, position_dtype: torch.dtype,
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Flat positions (ascending, ``position_dtype``) and new values (integers of the
    elements' width) of the elements where the flat contiguous ``new`` differs bitwise from
    ``old``, found in one pass that also writes the changed elements into ``old``. None (and
    nothing written) where either is not a host tensor of 1, 2, 4 or 8-byte elements whose
    bytes start on an 8-byte boundary."""
    new_elements, old_elements = _unsigned(new), _unsigned(old)
    if new_elements is None or old_elements is None or new.numel() != old.numel():
        return None
    lanes = _WORD_BYTES // new.element_size()
    body = new.numel() - new.numel() % lanes
    new_words, old_words = _words(new_elements, body), _words(old_elements, body)
    if new_words is None or old_words is None:
        return None
    # room for every element; pages that are never written are never allocated
    positions = np.empty(new.numel(), dtype=_POSITIONS[position_dtype])
    values = np.empty(new.numel(), dtype=new_elements.dtype)
    kernels = _compiled()
    found = kernels.diff_words(new_words, old_words, lanes, positions, values)
    found = kernels.diff_elements(new_elements[body:], old_elements[body:], body, positions, values,
                           found)
    return torch.from_numpy(positions[:found]), torch.from_numpy(values[:found])


def scatter_checked(target: torch.Tensor, positions: torch.Tensor,
                    values: torch.Tensor) -> int | None:
    """Write ``values`` (integers of ``target``'s element width) at the flat ``positions``
    of the flat contiguous host tensor ``target``, after checking that every position lies
    inside it. Returns -1 when written, the index of the first position outside ``target``
    (nothing written), or None where ``target`` is not such a tensor (nothing written)."""
    target_elements, new_values = _unsigned(target), _unsigned(values.contiguous())
    if target_elements is None or new_values is None or positions.device.type != "cpu" or (
            values.element_size() != target.element_size()):
        return None
    return int(_compiled().scatter(target_elements, positions.contiguous().numpy(), new_values))
