"""The engine handshake's typed structures: what a process's ``prepare()`` announces, and what
``build_topology`` hands each rank's ``init_process_group``.

Each engine family declares both as :class:`Handshake` structures (msgspec Structs: frozen,
keyword-only, unknown keys refused), checked once where they arrive. Between processes they
travel in verl's shape, as plain data (:func:`to_wire`: dicts, lists, strings, numbers; a
torch dtype by its name), so a verl worker group, or anything else that carries plain data,
drives them unchanged, and nothing of them needs pickle. :func:`from_wire` builds the
structure back and, where the data does not fit, says which key is wrong and why, in the
words an error message carries (``"without 'port' (it holds 'host')"``, ``"whose 'port' is
'29500', not a port number (an integer from 1 to 65535)"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

import msgspec

from weightsync_core.api.conversion import describe_type
from weightsync_core.api.dtypes import decode_hook, encode_hook

__all__ = [
    "Count",
    "Handshake",
    "HandshakeMismatch",
    "Port",
    "Text",
    "from_wire",
    "to_wire",
]

H = TypeVar("H", bound="Handshake")

Text = Annotated[str, msgspec.Meta(min_length=1, description="a non-empty string")]
"""A non-empty string (an address, an id)."""
Port = Annotated[int, msgspec.Meta(ge=1, le=65535,
                                   description="a port number (an integer from 1 to 65535)")]
"""A TCP port a process listens on."""
Count = Annotated[int, msgspec.Meta(ge=1, description="an integer >= 1")]
"""A positive count."""


class Handshake(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of an engine family's handshake structures (its announcement, its group
    arguments). A structure without fields is the handshake of an engine that needs none."""


class HandshakeMismatch(ValueError):
    """Data that is not the handshake structure it should be.

    Attributes:
        problem: what is wrong, worded to follow "returned metadata ..." or "arguments ..."
            (``"without 'endpoint' (it holds 'address')"``).
    """

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


def to_wire(value: Handshake) -> dict[str, Any]:
    """``value`` as plain data (verl's shape: a dict of its fields), a torch dtype by name."""
    return msgspec.to_builtins(value, enc_hook=encode_hook)


def _short(value: Any) -> str:
    """``repr(value)``, cut to a length an error message can carry."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _build(data: Any, kind: Any) -> Any:
    return msgspec.convert(data, kind, dec_hook=decode_hook)


def _problem(data: Any, kind: type[Handshake]) -> str:
    """What keeps ``data`` from being a ``kind``: the first key that is missing, unknown or
    of the wrong kind, each field checked on its own."""
    if not isinstance(data, Mapping):
        return f"that is not a dict but {type(data).__name__} {_short(data)}"
    fields = msgspec.structs.fields(kind)
    names = {field.name for field in fields}
    held = ", ".join(map(repr, data)) or "nothing"
    for field in fields:
        if field.required and field.name not in data:
            return f"without {field.name!r} (it holds {held})"
    for key in data:
        if key not in names:
            return (f"with the unknown key {key!r} (a {kind.__name__} holds "
                    f"{', '.join(sorted(names))})")
    for field in fields:
        if field.name not in data:
            continue
        try:
            _build(data[field.name], field.type)
        except (msgspec.ValidationError, ValueError, TypeError):
            return (f"whose {field.name!r} is {_short(data[field.name])}, not "
                    f"{describe_type(field.type)}")
    return "that does not fit its engine's handshake"


def from_wire(data: Any, kind: type[H]) -> H:
    """Build ``kind`` from plain data (:func:`to_wire`'s, or a verl-written peer's dict).

    Raises:
        HandshakeMismatch: ``data`` is not a ``kind`` (its ``problem`` names the key).
    """
    try:
        return _build(data, kind)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        error = exc
    raise HandshakeMismatch(_problem(data, kind)) from error
