"""Typed engine options: what ``engine_kwargs`` may say to each backend.

Every engine declares its options as a frozen dataclass (:class:`EngineOptions` or a
subclass) in its ``options_class``. The driver checks a configuration's ``engine_kwargs``
against it when the config or the manager is built, before any Ray actor starts: an unknown
option, a value of the wrong type (``rebuild_group='false'``, ``group_init_timeout='5'``) or
an out-of-range value fails there, naming the backend, the option, what was given and what
is accepted. Each engine then reads its options from ``self.options``. What depends on the
machine (that ``host`` is an address of it) is checked where the engine is built, in its own
process (:meth:`EngineOptions.check_local`), not on the driver.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from weightsync_core.api.conversion import ConversionError, convert
from weightsync_core.api.errors import EngineOptionsError
from weightsync_core.api.hosts import HOST_ENV, check_bind_host, default_host

__all__ = ["CONFIG_SETTINGS", "EngineOptions", "parse_options", "unknown_option"]

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
        """Check ranges and combinations (types are checked before: :func:`parse_options`):
        here, that every number is finite (an infinite timeout would wait forever, a NaN
        size compares false with everything)."""
        for option in dataclasses.fields(self):
            value = getattr(self, option.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"option {option.name!r} must be a finite number, got {value!r}")

    def check_local(self, backend: str) -> None:
        """Check what only the process that uses these options can check, on its own
        machine: called where the engine is built in that process
        (:func:`weightsync_core.worker.lifecycle.build_engine`), never on the driver, whose machine
        may not be the engine's (an address of a worker's machine is no address of the
        driver's). Here: the address this process binds (a ``host`` option, else
        ``WEIGHTSYNC_HOST``, else the Ray node's IP) must be one of this machine's.
        Options without a ``host`` field bind nothing and pass.

        Raises:
            EngineOptionsError: naming the option (or ``WEIGHTSYNC_HOST``), the value, what
                is accepted and how to fix it.
        """
        if "host" not in {option.name for option in dataclasses.fields(self)}:
            return
        host = getattr(self, "host", None)
        if host is not None and not isinstance(host, str):
            return  # the type check refused it already
        try:
            check_bind_host(host or default_host(), setting=_host_setting(backend, host))
        except ValueError as exc:
            raise EngineOptionsError(f"backend {backend!r}: {exc}") from exc


def _host_setting(backend: str, host: str | None) -> str:
    """Where the address an engine binds comes from, as its error names it."""
    if host:
        return f"option 'host' (engine_kwargs[{backend!r}]['host'])"
    if os.environ.get(HOST_ENV):
        return f"{HOST_ENV} (this process's environment; option 'host' is not set)"
    return f"the Ray node's address (neither option 'host' nor {HOST_ENV} is set)"


def parse_options(options_class: type[OptionsT], backend: str, given: Mapping[str, Any]
                  ) -> OptionsT:
    """Check ``given`` against ``options_class`` and build it (with
    :func:`weightsync_core.api.conversion.convert`, the workspace's one typed converter).

    Raises:
        EngineOptionsError: an unknown option (with "did you mean"), a value whose type the
            field does not accept, or a value the options' own checks refuse.
    """
    try:
        return convert(dict(given), options_class)
    except ConversionError as exc:
        name = exc.path[0] if exc.path else ""
        if exc.kind == "unknown":
            message = unknown_option(backend, name, exc.value, list(exc.choices))
        elif exc.kind == "type":
            message = (
                f"backend {backend!r}: option {name!r} must be {exc.expected}, got "
                f"{exc.value!r} ({type(exc.value).__name__}); fix "
                f"engine_kwargs[{backend!r}][{name!r}]"
            )
        else:
            message = f"backend {backend!r}: {exc.reason}"
        raise EngineOptionsError(message) from None


def unknown_option(backend: str, name: str, value: Any, accepted: list[str]) -> str:
    """The error message for an option ``backend`` does not have, with the closest name."""
    close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"backend {backend!r} has no option {name!r} (given {value!r}).{hint} Its options: "
        f"{', '.join(accepted) or 'none'}."
    )
