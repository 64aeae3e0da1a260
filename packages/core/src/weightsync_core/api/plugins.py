"""Safe loading of user modules and classes named in configuration.

Configuration may name a module to import (``custom_backend_module``) or a class to build
(``checkpoint_manager_class``). Only dotted Python names are accepted: file paths, URLs and
relative names are refused, and so is a ``custom_backend_module`` inside
``weightsync_core`` (whose backends are registered already). An operator can restrict which
modules may be loaded by setting ``WEIGHTSYNC_TRUSTED_MODULES`` to a comma-separated list of
module prefixes; a configuration file cannot change that. The list in force on the driver
when a :class:`~weightsync_core.api.config.CheckpointEngineConfig` is built, narrowed by the one
in force wherever it is pickled to go to another process (as Ray hands it to a worker),
travels with it (``trusted_modules``): every process that loads the config's modules applies
it as well as its own environment's, so a worker started before the variable was set (it
does not see variables set in the driver after ``ray.init``) refuses what the driver
refuses, even where the config was built before the variable was set.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from collections.abc import Sequence
from typing import TypeVar

from weightsync_core.api.errors import PluginError
from weightsync_core.api.registry import CheckpointEngineRegistry

__all__ = [
    "TRUSTED_MODULES_ENV",
    "allowed_by_both",
    "custom_module_names",
    "load_class",
    "load_custom_backend_module",
    "trusted_module_prefixes",
    "validate_module_name",
]

logger = logging.getLogger(__name__)

TRUSTED_MODULES_ENV = "WEIGHTSYNC_TRUSTED_MODULES"

_CORE = "weightsync_core"

_DOTTED_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

T = TypeVar("T")

_registered_by_module: dict[str, list[str]] = {}


def validate_module_name(
    name: object, *, setting: str = "custom_backend_module",
    trusted: Sequence[str] | None = None,
) -> str:
    """Return ``name`` if it is an absolute dotted module name allowed by the operator.

    Args:
        name: the module name.
        setting: the setting that named it, for errors.
        trusted: the driver's ``WEIGHTSYNC_TRUSTED_MODULES`` prefixes (a config's
            ``trusted_modules``), applied as well as this process's own; None: none.

    Raises:
        PluginError: the value is not a string, looks like a path or URL, is relative, or is
            outside the prefixes listed in ``WEIGHTSYNC_TRUSTED_MODULES`` (this process's,
            or the driver's as ``trusted`` carries it).
    """
    if not isinstance(name, str) or not name.strip():
        raise PluginError(f"{setting} must be a dotted module name such as 'my_pkg.backend', "
                          f"got {name!r}")
    if "://" in name:
        problem = "looks like a URL"
    elif "/" in name or "\\" in name or name.endswith(".py"):
        problem = "looks like a file path"
    elif name.startswith("."):
        problem = "is a relative module name"
    elif not _DOTTED_NAME.fullmatch(name):
        problem = "is not a valid dotted Python module name"
    else:
        problem = None
    if problem is not None:
        raise PluginError(
            f"{setting}={name!r} {problem}. Only importable, absolute dotted module names are "
            "accepted (e.g. 'my_company.weightsync_backend'); install the module or put its "
            "directory on PYTHONPATH in every process instead of pointing at a file."
        )
    _check_allowed(name, setting, trusted_module_prefixes(), "")
    if trusted is not None:
        _check_allowed(name, setting, list(trusted), (
            " in the driver's environment (carried to this process by the "
            "CheckpointEngineConfig built there, as its trusted_modules)"
        ))
    return name


def _inside(name: str, prefix: str) -> bool:
    """Whether module ``name`` is ``prefix`` or inside it."""
    return name == prefix or name.startswith(prefix + ".")


def _check_allowed(name: str, setting: str, trusted: list[str] | None, where: str) -> None:
    """Refuse ``name`` unless it is, or is inside, one of the ``trusted`` prefixes (None:
    every name is allowed); ``where`` says whose allowlist it is."""
    if trusted is not None and not any(_inside(name, prefix) for prefix in trusted):
        listed = ",".join(trusted) or "(no prefix both of its lists allow)"
        raise PluginError(
            f"{setting}={name!r} is not allowed: the operator restricted loadable modules with "
            f"{TRUSTED_MODULES_ENV}={listed}{where}. Ask the operator to add its "
            "package prefix to that variable."
        )


def allowed_by_both(first: Sequence[str] | None, second: Sequence[str] | None
                    ) -> tuple[str, ...] | None:
    """The module prefixes that allow exactly the names both allowlists allow (None: no
    list, every name allowed): where one prefix is inside the other, the inner one."""
    if first is None or second is None:
        either = first if second is None else second
        return tuple(either) if either is not None else None
    inner = {a for a in first for b in second if _inside(a, b)}
    inner |= {b for b in second for a in first if _inside(b, a)}
    return tuple(sorted(inner))


def load_custom_backend_module(
    module: str | Sequence[str] | None, trusted: Sequence[str] | None = None
) -> list[str]:
    """Import the module(s) named by ``custom_backend_module`` so their backends register.

    Call this in every process that builds an engine (driver and each Ray worker), with the
    config's ``trusted_modules`` as ``trusted`` (the driver's allowlist); it is idempotent.
    Returns the backend names the module(s) registered.

    Raises:
        PluginError: a name is refused (see :func:`validate_module_name`), the import fails,
            or the module registered no backend.
    """
    registered: list[str] = []
    for name in custom_module_names(module, trusted):
        registered.extend(_import_backend_module(name))
    return registered


def custom_module_names(
    module: str | Sequence[str] | None, trusted: Sequence[str] | None = None
) -> list[str]:
    """The module names a ``custom_backend_module`` setting gives, each checked (without
    importing anything) against this process's allowlist and ``trusted`` (the driver's).

    Raises:
        PluginError: a name is refused (see :func:`validate_module_name`), or names a module
            of ``weightsync_core``.
    """
    if module is None:
        return []
    modules = [module] if isinstance(module, str) else list(module)
    return [_not_core(validate_module_name(name, trusted=trusted)) for name in modules]


def _not_core(name: str) -> str:
    """``name``, unless it is a module of ``weightsync_core`` (which registers its backends
    when it is imported: a core module names no backend of its own).

    Raises:
        PluginError: naming the module and the backends core registers.
    """
    if _inside(name, _CORE):
        core_backends = [backend for backend in CheckpointEngineRegistry.names()
                         if _inside(CheckpointEngineRegistry.get(backend).__module__, _CORE)]
        raise PluginError(
            f"custom_backend_module={name!r} is a module of {_CORE}, whose backends "
            f"({', '.join(core_backends)}) are registered already: a core module registers "
            "nothing of its own. Drop it and set backend= to the backend's name, or name the "
            "module of your own that registers one"
        )
    return name


def trusted_module_prefixes() -> list[str] | None:
    """The module prefixes ``WEIGHTSYNC_TRUSTED_MODULES`` allows in this process's
    environment, or None where it is unset or empty (every module allowed)."""
    raw = os.environ.get(TRUSTED_MODULES_ENV)
    if raw is None or not raw.strip():
        return None
    return [part.strip() for part in raw.split(",") if part.strip()]


def load_class(
    qualified_name: str, base: type[T], *, setting: str = "checkpoint_manager_class"
) -> type[T]:
    """Load ``package.module.ClassName`` (or ``package.module:ClassName``) under the same policy
    as :func:`load_custom_backend_module` and check that it subclasses ``base``."""
    if not isinstance(qualified_name, str):
        raise PluginError(f"{setting} must be a fully-qualified class name, got {qualified_name!r}")
    if "://" in qualified_name:
        validate_module_name(qualified_name, setting=setting)  # refused as a URL
    module_name, sep, class_name = qualified_name.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise PluginError(
            f"{setting}={qualified_name!r} must be fully qualified, e.g. "
            "'my_pkg.sync.MyCheckpointEngineManager'"
        )
    validate_module_name(module_name, setting=setting)
    module = _import(module_name, setting)
    obj = getattr(module, class_name, None)
    if obj is None:
        raise PluginError(f"{setting}={qualified_name!r}: module {module_name!r} has no "
                          f"attribute {class_name!r}")
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise PluginError(
            f"{setting}={qualified_name!r} is not a subclass of "
            f"{base.__module__}.{base.__qualname__}"
        )
    return obj


def _import(name: str, setting: str):
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        raise PluginError(
            f"{setting}={name!r} could not be imported: {type(exc).__name__}: {exc}"
        ) from exc
    logger.info("weightsync loaded %s=%s from %s", setting, name, getattr(module, "__file__", "?"))
    return module


def _import_backend_module(name: str) -> list[str]:
    if name in _registered_by_module:
        return _registered_by_module[name]
    before = set(CheckpointEngineRegistry.names())
    _import(name, "custom_backend_module")
    registry = CheckpointEngineRegistry._registry
    added = sorted(set(registry) - before)
    if not added:
        added = sorted(
            backend for backend, engine in registry.items()
            if engine.__module__ == name or engine.__module__.startswith(name + ".")
        )
    if not added:
        raise PluginError(
            f"custom_backend_module={name!r} was imported but registered no backend. Decorate "
            "your engine class with @CheckpointEngineRegistry.register('<name>') at module level."
        )
    _registered_by_module[name] = added
    return added
