"""Typed engine options: what ``engine_kwargs`` may say to each backend.

Every engine declares its options as a frozen dataclass (:class:`EngineOptions` or a
subclass) in its ``options_class``. The driver checks a configuration's ``engine_kwargs``
against it when the config or the manager is built, before any Ray actor starts: an unknown
option, a value of the wrong type (``rebuild_group='false'``, ``group_init_timeout='5'``) or
an out-of-range value fails there, naming the backend, the option, what was given and what
is accepted. Each engine then reads its options from ``self.options``.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from weightsync_core.errors import EngineOptionsError

if TYPE_CHECKING:
    from weightsync_core.base import CheckpointEngine

__all__ = ["CONFIG_SETTINGS", "EngineOptions", "check_engine_kwargs", "parse_options"]

OptionsT = TypeVar("OptionsT", bound="EngineOptions")

CONFIG_SETTINGS: Mapping[str, str] = {
    "verify": "verify",
    "timeout": "sync_timeout_seconds",
    "rollout_dtype": "rollout_dtype",
    "bucket_size": "update_weights_bucket_megabytes",
}
"""Engine constructor arguments that come from the config itself, not ``engine_kwargs``
(argument -> the ``CheckpointEngineConfig`` field to set instead)."""


@dataclass(frozen=True)
class EngineOptions:
    """Options every engine takes.

    Attributes:
        is_master: verl's workers pass ``True`` on actor rank 0. weightsync takes the sync's
            master from the topology (actor rank 0 too), so the flag is recorded only.

    Subclasses add their backend's options as typed fields with defaults, and check ranges
    and combinations in ``__post_init__`` (calling ``super().__post_init__()`` first) by
    raising ``ValueError`` naming the option.
    """

    is_master: bool = False

    def __post_init__(self) -> None:
        """Check ranges and combinations (types are checked before: :func:`parse_options`)."""


def parse_options(options_class: type[OptionsT], backend: str, given: Mapping[str, Any]
                  ) -> OptionsT:
    """Check ``given`` against ``options_class`` and build it.

    Raises:
        EngineOptionsError: an unknown option (with "did you mean"), a value whose type the
            field does not accept, or a value the options' own checks refuse.
    """
    fields = {item.name: item for item in dataclasses.fields(options_class)}
    hints = get_type_hints(options_class)
    for name, value in given.items():
        if name not in fields:
            raise EngineOptionsError(_unknown(backend, name, value, sorted(fields)))
        if not _accepts(hints[name], value):
            raise EngineOptionsError(
                f"backend {backend!r}: option {name!r} must be {_describe(hints[name])}, got "
                f"{value!r} ({type(value).__name__}); fix engine_kwargs[{backend!r}][{name!r}]"
            )
    try:
        return options_class(**given)
    except (ValueError, TypeError) as exc:
        raise EngineOptionsError(f"backend {backend!r}: {exc}") from exc


def check_engine_kwargs(backend: str, engine_cls: type[CheckpointEngine],
                        given: Mapping[str, Any]) -> None:
    """Check one backend's ``engine_kwargs`` on the driver, before any process starts.

    An engine with typed options is checked field by field (:func:`parse_options`). An engine
    written for verl, which has its own constructor and no ``options_class`` of its own, is
    checked by its constructor's keyword names.
    """
    for name in given:
        if name in CONFIG_SETTINGS:
            raise EngineOptionsError(
                f"backend {backend!r}: {name!r} is a setting of the whole config, not an engine "
                f"option; set CheckpointEngineConfig.{CONFIG_SETTINGS[name]} instead of "
                f"engine_kwargs[{backend!r}][{name!r}]"
            )
    if engine_cls.declares_options():
        parse_options(engine_cls.options_class, backend, given)
        return
    parameters = inspect.signature(engine_cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    accepted = sorted(name for name in parameters if name not in CONFIG_SETTINGS)
    for name, value in given.items():
        if name not in parameters:
            raise EngineOptionsError(_unknown(backend, name, value, accepted))


def _unknown(backend: str, name: str, value: Any, accepted: list[str]) -> str:
    close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"backend {backend!r} has no option {name!r} (given {value!r}).{hint} Its options: "
        f"{', '.join(accepted) or 'none'}."
    )


def _accepts(hint: Any, value: Any) -> bool:
    """Whether ``value`` is of the type ``hint`` names (strictly: no ``"false"`` for a
    ``bool``, no ``True`` for an ``int``; an ``int`` is a fine ``float``)."""
    origin = get_origin(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_accepts(arm, value) for arm in get_args(hint))
    if origin is Literal:
        return value in get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        key, item = get_args(hint) or (Any, Any)
        return isinstance(value, Mapping) and all(
            _accepts(key, k) and _accepts(item, v) for k, v in value.items())
    if origin is not None and isinstance(origin, type) and issubclass(origin, Sequence):
        (item, *_) = get_args(hint) or (Any,)
        return (isinstance(value, Sequence) and not isinstance(value, str)
                and all(_accepts(item, v) for v in value))
    return isinstance(value, hint) if isinstance(hint, type) else True


def _describe(hint: Any) -> str:
    """``hint`` in words, for error messages."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in get_args(hint))
    words = {bool: "True or False", int: "an integer", float: "a number", str: "a string",
             type(None): "None"}
    if hint in words:
        return words[hint]
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        key, item = get_args(hint) or (Any, Any)
        return f"a mapping of {_describe(key)} to {_describe(item)}"
    if origin is not None and isinstance(origin, type) and issubclass(origin, Sequence):
        return f"a list of {_describe((get_args(hint) or (Any,))[0])}"
    return "anything" if hint is Any else getattr(hint, "__name__", str(hint))
