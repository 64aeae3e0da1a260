"""Typed conversion: plain data (``engine_kwargs``, a trainer's YAML, an info dict that crossed a
process boundary) into a typed structure, strictly, with errors a user can act on.

One converter for the whole workspace: :func:`convert` builds a dataclass (nested dataclasses,
mappings, sequences, unions and literals included) with msgspec's strict conversion (no
``"false"`` for a ``bool``, no ``True`` for an ``int``; an ``int`` is a fine ``float``), after
refusing keys the structure does not have. A refusal is a :class:`ConversionError` that names
the field (its dotted path), what the field accepts in words, the value given, and for an
unknown key the closest valid names; callers word it for their own setting (an engine option,
a configuration key) from those parts. Where a conversion fails, the failing field is found by
converting the structure's fields one by one, each with msgspec (never by reading msgspec's
message).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from collections.abc import Mapping, Sequence
from typing import (
    Annotated,
    Any,
    Literal,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

import msgspec

from weightsync_core.api.dtypes import decode_hook

__all__ = ["ConversionError", "check_fields", "convert", "describe_type"]

T = TypeVar("T")



@dataclasses.dataclass
class ConversionError(ValueError):
    """Data that does not fit the structure it is converted into.

    Attributes:
        kind: ``"unknown"`` (a key the structure has no field for), ``"type"`` (a value of a
            type the field does not accept) or ``"invalid"`` (refused by the structure's own
            checks, its ``__post_init__``).
        path: the field's names from the top (``("trainer", "total_steps")``); empty for the
            whole value.
        value: what was given there (``None`` also when nothing could be found).
        expected: what the field accepts, in words (``kind == "type"``).
        reason: the structure's own words (``kind == "invalid"``).
        choices: the valid names beside an unknown key (``kind == "unknown"``).
        close: the valid names closest to an unknown key, best first (dotted paths).
        error: the exception the structure's own checks raised (``kind == "invalid"``), for
            callers whose structures raise errors of their own type.
    """

    kind: Literal["unknown", "type", "invalid"]
    path: tuple[str, ...]
    value: Any = None
    expected: str = ""
    reason: str = ""
    choices: tuple[str, ...] = ()
    close: tuple[str, ...] = ()
    error: BaseException | None = None

    def __post_init__(self) -> None:
        super().__init__(str(self))

    @property
    def where(self) -> str:
        """The dotted path of the field (``"the value"`` for the whole value)."""
        return ".".join(self.path) or "the value"

    def __str__(self) -> str:
        if self.kind == "unknown":
            hint = f" Did you mean {' or '.join(map(repr, self.close))}?" if self.close else ""
            return (f"unknown key {self.where!r} (given {self.value!r}).{hint} Valid keys: "
                    f"{', '.join(self.choices) or 'none'}")
        if self.kind == "type":
            return (f"{self.where} must be {self.expected}, got {self.value!r} "
                    f"({type(self.value).__name__})")
        return self.reason if not self.path else f"{self.where}: {self.reason}"


def convert(data: Any, target: type[T]) -> T:
    """Build ``target`` (a dataclass, or any type msgspec builds: ``list[int]``,
    ``torch.dtype``, ...) from ``data`` (plain mappings, sequences, scalars; a torch dtype may
    be given by its name, as MessagePack carries it).

    Raises:
        ConversionError: an unknown key, a value of the wrong type, or a value ``target``'s own
            checks refuse (their ``ValueError``/``TypeError`` message is kept as ``reason``).
    """
    _refuse_unknown_keys(data, target, ())
    try:
        return _strict(data, target)
    except msgspec.ValidationError as exc:
        error = exc
    # outside the handler: the fields' own conversions must not chain to this error
    raise _failure(data, target, ()) or _refused(error, ())


def check_fields(instance: Any) -> None:
    """Check a dataclass instance's field values against their annotations, as
    :func:`convert` would have (for a structure built in Python rather than converted): each
    field's type, and the bounds a ``typing.Annotated[..., msgspec.Meta(...)]`` sets. Call it
    from ``__post_init__``, before the checks across fields.

    Raises:
        ConversionError: the first field whose value does not fit (``kind == "type"``).
    """
    hints = get_type_hints(type(instance), include_extras=True)
    for field in dataclasses.fields(instance):
        if field.init:
            found = _failure(getattr(instance, field.name), hints[field.name], (field.name,))
            if found is not None:
                raise found


def describe_type(hint: Any) -> str:
    """``hint`` in words, for error messages (``"True or False"``, ``"an integer or None"``,
    ``"an integer > 0 and <= 64"``; a ``msgspec.Meta``'s own description where it has one)."""
    origin = get_origin(hint)
    if origin is Annotated:
        base, *extras = get_args(hint)
        meta = next((extra for extra in extras if isinstance(extra, msgspec.Meta)), None)
        if meta is not None and meta.description:
            return meta.description
        bounds = [f"{sign} {getattr(meta, name)}" for name, sign in _BOUNDS
                  if meta is not None and getattr(meta, name) is not None]
        return " ".join([describe_type(base), " and ".join(bounds)]) if bounds else describe_type(
            base)
    if origin in (Union, types.UnionType):
        return " or ".join(describe_type(arm) for arm in get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in get_args(hint))
    words = {bool: "True or False", int: "an integer", float: "a number", str: "a string",
             type(None): "None"}
    if hint in words:
        return words[hint]
    if dataclasses.is_dataclass(hint):
        return "a mapping of keys"
    if _is(hint, msgspec.Struct):
        return f"a {hint.__name__} ({', '.join(hint.__struct_fields__)})"
    if _is(origin or hint, Mapping):
        key, item = get_args(hint) or (Any, Any)
        return f"a mapping of {describe_type(key)} to {describe_type(item)}"
    if _is(origin or hint, Sequence):
        return f"a list of {describe_type((get_args(hint) or (Any,))[0])}"
    return "anything" if hint is Any else getattr(hint, "__name__", str(hint))


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "of length >="),
           ("max_length", "of length <="))
"""``msgspec.Meta``'s bounds and their words."""


def _is(kind: Any, base: type) -> bool:
    return isinstance(kind, type) and issubclass(kind, base) and kind is not str


def _dataclass_arm(hint: Any, value: Any) -> type | None:
    """The dataclass ``hint`` (or one arm of a union ``hint``) that ``value`` would fill."""
    if not isinstance(value, Mapping):
        return None
    arms = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    found = [arm for arm in arms if dataclasses.is_dataclass(arm) and isinstance(arm, type)]
    return found[0] if len(found) == 1 else None


def _refuse_unknown_keys(data: Any, target: type, path: tuple[str, ...]) -> None:
    if not isinstance(data, Mapping) or not dataclasses.is_dataclass(target):
        return  # msgspec names the type error, or checks the keys itself
    fields = {f.name for f in dataclasses.fields(target) if f.init}  # pyright: ignore[reportArgumentType]
    hints = get_type_hints(target)
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=3)
            raise ConversionError(
                "unknown", (*path, str(key)), value, choices=tuple(sorted(fields)),
                close=tuple(".".join((*path, name)) for name in close),
            )
        nested = _dataclass_arm(hints[key], value)
        if nested is not None:
            _refuse_unknown_keys(value, nested, (*path, key))


def _strict(data: Any, target: Any) -> Any:
    return msgspec.convert(data, target, strict=True, dec_hook=decode_hook)


def _failure(data: Any, hint: Any, path: tuple[str, ...]) -> ConversionError | None:
    """Why ``data`` does not convert to ``hint``, found at the deepest field that refuses it
    (each field converted on its own, a nested dataclass field by field); None if it does."""
    structure = _dataclass_arm(hint, data)
    if structure is None:
        try:
            _strict(data, hint)
        except msgspec.ValidationError as exc:
            if exc.__cause__ or exc.__context__:  # a decode hook's refusal, in its own words
                return _refused(exc, path)
            return ConversionError("type", path, data, expected=describe_type(hint))
        return None
    hints = get_type_hints(structure, include_extras=True)
    for key, value in data.items():
        found = _failure(value, hints[key], (*path, str(key)))
        if found is not None:
            return found
    try:  # every field fits: the structure's own checks (or a missing field) refuse it
        _strict(data, structure)
    except msgspec.ValidationError as exc:
        return _refused(exc, path)
    return None


def _refused(error: msgspec.ValidationError, path: tuple[str, ...]) -> ConversionError:
    """A structure's refusal of values that each fit their field: its own check's error (a
    ``ValueError``/``TypeError`` from ``__post_init__``), or msgspec's (a missing field)."""
    cause = error.__cause__ or error.__context__
    return ConversionError("invalid", path, reason=str(cause or error), error=cause)
