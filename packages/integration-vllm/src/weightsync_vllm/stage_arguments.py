"""A sync's stage arguments as they cross vLLM's process boundaries, and back.

vLLM carries ``collective_rpc`` arguments between its processes as MessagePack (``AsyncLLM``'s
engine core and workers), which refuses what MessagePack has no type for (``Object of type
<class 'torch.dtype'> is not serializable``). weightsync's engines hand their handshake on as
plain data already (:class:`~weightsync_core.spi.TypedEngine`); an engine written for verl
may take dataclasses or dtypes. The rollout actor sends every stage's arguments as plain data
(:func:`plain_arguments`: dataclasses as dicts, a dtype by its name), and vLLM's worker
rebuilds the types the engine method annotates (:func:`typed_arguments`). Both vLLM front
ends take the same path, so what works in one process works across them.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from weightsync_core import WeightSyncError, convert

__all__ = ["plain_arguments", "typed_arguments"]


def _plain_value(value: Any) -> Any:
    """What MessagePack carries for ``value`` where msgspec has no rule of its own."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    raise WeightSyncError(
        f"a weight-sync stage argument of type {type(value).__name__} cannot cross vLLM's "
        "process boundary (MessagePack): stage arguments must be plain data, dataclasses or "
        "torch dtypes"
    )


def plain_arguments(kwargs: Any) -> Any:
    """``kwargs`` (a stage's arguments, or a list of them, one per rank) as plain MessagePack
    data: dataclasses as dicts, a ``torch.dtype`` by its name, bytes kept (MessagePack then
    delivers tuples as lists)."""
    return msgspec.to_builtins(kwargs, builtin_types=(bytes, bytearray, memoryview),
                               enc_hook=_plain_value)


def typed_arguments(function: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` converted to ``function``'s annotated parameter types.

    vLLM carries ``collective_rpc`` arguments to its workers as msgpack, which turns a
    dataclass into a dict and a tuple into a list (and the rollout actor sends dtypes by
    name); an engine's ``init_process_group`` that annotates typed values (one written for
    verl, say) gets them rebuilt here from its annotations."""
    try:
        hints = typing.get_type_hints(function)
    except (NameError, TypeError):  # annotations that do not resolve here: left as sent
        return kwargs
    # weightsync's strict converter: a dataclass refuses a key it does not have, a dtype
    # comes back from its name
    return {name: convert(value, hints[name]) if name in hints else value
            for name, value in kwargs.items()}
