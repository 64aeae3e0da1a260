"""Backend registry: backend name -> :class:`CheckpointEngine` subclass.

Backends come from three sources, consulted in this order:

1. classes registered with :meth:`CheckpointEngineRegistry.register` (the decorator);
2. the ``weightsync.backends`` entry-point group of installed distributions; the values stay
   strings until a backend is asked for, so listing backends imports nothing heavy;
3. a table of first-party backends and the distribution providing each, used only to tell
   the user what to install.
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from weightsync_core.api.errors import (
    BackendLoadError,
    BackendNotFoundError,
    BackendNotInstalledError,
    BackendRegistrationError,
)

if TYPE_CHECKING:
    from weightsync_core.api.engine import CheckpointEngine

__all__ = [
    "ENTRY_POINT_GROUP",
    "KNOWN_BACKENDS",
    "BackendInfo",
    "BackendState",
    "CheckpointEngineRegistry",
    "KnownBackend",
]

ENTRY_POINT_GROUP = "weightsync.backends"

EngineT = TypeVar("EngineT", bound="type[CheckpointEngine]")


@dataclass(frozen=True)
class KnownBackend:
    """A first-party backend: which distribution provides it and what it needs."""

    distribution: str
    description: str
    requires: str = ""

    @property
    def install_hint(self) -> str:
        """The command that installs the distribution."""
        return f"pip install {self.distribution}  (or: uv add {self.distribution})"


KNOWN_BACKENDS: Mapping[str, KnownBackend] = {
    "naive": KnownBackend("weightsync-core", "colocated: actor and rollout share a process"),
    "gloo": KnownBackend("weightsync-core", "collective broadcast over gloo on host memory"),
    "gloo_sharded": KnownBackend(
        "weightsync-core", "sharded delivery: each worker its slices, point to point over gloo"
    ),
    "nccl": KnownBackend(
        "weightsync-nccl", "collective broadcast over NCCL on CUDA devices", "CUDA GPUs"
    ),
    "hccl": KnownBackend(
        "weightsync-hccl", "collective broadcast over HCCL on Ascend NPUs", "torch_npu"
    ),
    "nixl": KnownBackend("weightsync-nixl", "pipelined ring over NIXL (UCX, ...)", "nixl"),
    "nixl_sharded": KnownBackend(
        "weightsync-nixl", "sharded delivery: every actor rank writes slices over NIXL", "nixl"
    ),
    "mooncake": KnownBackend(
        "weightsync-mooncake",
        "pipelined ring over Mooncake Transfer Engine",
        "mooncake-transfer-engine",
    ),
    "mooncake_sharded": KnownBackend(
        "weightsync-mooncake",
        "sharded delivery: every actor rank writes slices over Mooncake Transfer Engine",
        "mooncake-transfer-engine",
    ),
    "kimi": KnownBackend(
        "weightsync-kimi",
        "every actor rank serves its share; receivers pull peer-to-peer, then broadcast",
        "mooncake-transfer-engine",
    ),
    "kimi_ckpt_engine": KnownBackend(
        "weightsync-kimi", "alias of 'kimi' (the name verl configs use)", "mooncake-transfer-engine"
    ),
}


class BackendState(enum.StrEnum):
    """Where a backend stands in this process."""

    LOADED = "loaded"
    INSTALLED = "installed"
    NOT_INSTALLED = "not installed"
    BROKEN = "broken"


@dataclass(frozen=True)
class BackendInfo:
    """One row of :meth:`CheckpointEngineRegistry.available`.

    ``install_hint`` is the command to run only where the distribution is missing (or too
    old to provide the backend); a broken backend's distribution is installed, so its
    ``reason`` (the load error, with its own fix) says what to do instead.
    """

    name: str
    state: BackendState
    distribution: str | None
    target: str | None
    reason: str | None
    install_hint: str | None
    description: str = ""


def _distribution_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _origin(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = entry_point.dist.name if entry_point.dist is not None else "?"
    return f"{dist} ({entry_point.value})"


def _describe_import_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause) not in text:
        text += f" (caused by {type(cause).__name__}: {cause})"
    return text


class CheckpointEngineRegistry:
    """Name -> engine class, with lazy entry points and install hints for missing backends."""

    _registry: ClassVar[dict[str, type[CheckpointEngine]]] = {}
    _broken: ClassVar[dict[str, str]] = {}
    _entry_points: ClassVar[dict[str, importlib.metadata.EntryPoint] | None] = None
    _conflicts: ClassVar[dict[str, str]] = {}

    @classmethod
    def register(cls, name: str) -> Callable[[EngineT], EngineT]:
        """Class decorator registering a :class:`CheckpointEngine` subclass under ``name``.

        Registering the same class twice is harmless; a different class under a taken name,
        or a class that does not subclass ``CheckpointEngine``, is refused.
        """
        if not isinstance(name, str) or not name:
            raise BackendRegistrationError(f"backend name must be a non-empty string: {name!r}")

        def decorator(engine_cls: EngineT) -> EngineT:
            cls._store(name, engine_cls)
            return engine_cls

        return decorator

    @classmethod
    def get(cls, name: str) -> type[CheckpointEngine]:
        """Return the engine class registered as ``name``, loading its entry point if needed.

        Raises:
            BackendNotInstalledError: a first-party backend whose distribution is missing.
            BackendLoadError: the backend's package is installed but failed to import.
            BackendNotFoundError: nothing of that name is known.
        """
        if name in cls._registry:
            return cls._registry[name]
        entry_point = cls._discover().get(name)
        if name in cls._conflicts:
            raise BackendRegistrationError(f"backend {name!r} is ambiguous: {cls._conflicts[name]}")
        if entry_point is not None:
            return cls._load_entry_point(name, entry_point)
        known = KNOWN_BACKENDS.get(name)
        available = ", ".join(sorted(cls._installed_names())) or "none"
        installed_version = _distribution_version(known.distribution) if known else None
        if known is not None and installed_version is not None:
            raise BackendNotInstalledError(
                f"checkpoint-engine backend {name!r} is not provided by the installed "
                f"{known.distribution} {installed_version}: that release has no "
                f"{ENTRY_POINT_GROUP!r} entry point for it. Upgrade it with: pip install -U "
                f"{known.distribution}. Backends available here: {available}."
            )
        if known is not None:
            raise BackendNotInstalledError(
                f"checkpoint-engine backend {name!r} ({known.description}) is provided by the "
                f"distribution {known.distribution!r}, which is not installed in this "
                f"environment. Install it with: {known.install_hint}. "
                f"Backends available here: {available}."
            )
        close = difflib.get_close_matches(name, [*cls._installed_names(), *KNOWN_BACKENDS], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise BackendNotFoundError(
            f"unknown checkpoint-engine backend {name!r}.{hint} Backends available here: "
            f"{available}. First-party backends: {', '.join(sorted(KNOWN_BACKENDS))}. "
            "For your own backend, register it with @CheckpointEngineRegistry.register(name) in a "
            "module named by custom_backend_module, or expose it in the "
            f"{ENTRY_POINT_GROUP!r} entry-point group."
        )

    @classmethod
    def new(cls, name: str, *args: Any, **kwargs: Any) -> CheckpointEngine:
        """Construct the engine registered as ``name`` with the given arguments."""
        return cls.get(name)(*args, **kwargs)

    @classmethod
    def holds(cls, name: str, other_than: type[CheckpointEngine] | None = None) -> bool:
        """Whether ``name`` is taken by an engine other than ``other_than``: registered in
        this process, or the name of an installed backend's entry point (loaded or not;
        nothing is imported to tell)."""
        registered = cls._registry.get(name)
        if registered is not None:
            return registered is not other_than
        return name in cls._discover()

    @classmethod
    def names(cls) -> list[str]:
        """Names registered in this process so far (decorator or loaded entry points)."""
        return sorted(cls._registry)

    @classmethod
    def available(cls, probe: bool = False) -> dict[str, BackendInfo]:
        """Every known backend with its state, keyed by name.

        Args:
            probe: import each installed-but-unloaded backend to report whether it loads.
                Off by default so that listing stays cheap.
        """
        entry_points = cls._discover()
        names = sorted({*cls._registry, *entry_points, *KNOWN_BACKENDS})
        report: dict[str, BackendInfo] = {}
        for name in names:
            if probe and name not in cls._registry and name in entry_points:
                with contextlib.suppress(BackendLoadError):
                    cls.get(name)
            report[name] = cls._info(name, entry_points.get(name))
        return report

    @classmethod
    def refresh(cls) -> None:
        """Forget the cached entry-point scan (after installing a package at run time)."""
        cls._entry_points = None
        cls._conflicts = {}

    @classmethod
    def _info(cls, name: str, entry_point: importlib.metadata.EntryPoint | None) -> BackendInfo:
        known = KNOWN_BACKENDS.get(name)
        distribution = known.distribution if known else None
        if entry_point is not None and entry_point.dist is not None:
            distribution = entry_point.dist.name
        target = entry_point.value if entry_point is not None else None
        description = known.description if known else ""
        hint = known.install_hint if known else None
        if name in cls._registry:
            engine = cls._registry[name]
            return BackendInfo(
                name, BackendState.LOADED, distribution,
                target or f"{engine.__module__}:{engine.__qualname__}", None, None, description,
            )
        reason = cls._conflicts.get(name) or cls._broken.get(name)
        if reason is not None:  # installed: the load error (or the clash) says what to fix
            return BackendInfo(
                name, BackendState.BROKEN, distribution, target, reason, None, description
            )
        if entry_point is not None:
            return BackendInfo(
                name, BackendState.INSTALLED, distribution, target, None, None, description
            )
        installed_version = _distribution_version(distribution) if distribution else None
        reason = f"{distribution} is not installed"
        if installed_version is not None:
            reason = f"{distribution} {installed_version} is installed but does not provide it"
            hint = f"pip install -U {distribution}"
        return BackendInfo(
            name, BackendState.NOT_INSTALLED, distribution, None, reason, hint, description
        )

    @classmethod
    def _installed_names(cls) -> set[str]:
        return {*cls._registry, *cls._discover()}

    @classmethod
    def _discover(cls) -> dict[str, importlib.metadata.EntryPoint]:
        if cls._entry_points is None:
            found: dict[str, importlib.metadata.EntryPoint] = {}
            for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                first = found.setdefault(entry_point.name, entry_point)
                if first.value != entry_point.value:
                    cls._conflicts[entry_point.name] = (
                        f"two installed distributions provide it: {_origin(first)} and "
                        f"{_origin(entry_point)}; uninstall one"
                    )
            cls._entry_points = found
        return cls._entry_points

    @classmethod
    def _load_entry_point(
        cls, name: str, entry_point: importlib.metadata.EntryPoint
    ) -> type[CheckpointEngine]:
        dist = entry_point.dist.name if entry_point.dist is not None else "its distribution"
        try:
            engine_cls = entry_point.load()
        except Exception as exc:
            reason = _describe_import_error(exc)
            cls._broken[name] = reason
            known = KNOWN_BACKENDS.get(name)
            needs = f" It needs {known.requires}." if known and known.requires else ""
            raise BackendLoadError(
                f"checkpoint-engine backend {name!r} is installed ({dist}, entry point "
                f"{entry_point.value!r}) but failed to load: {reason}.{needs} Fix the import "
                "error above (usually a missing native library or wrong wheel for this "
                "platform), then retry."
            ) from exc
        cls._store(name, engine_cls, f"entry point {entry_point.value!r} of {dist}")
        return engine_cls

    @classmethod
    def _store(cls, name: str, engine_cls: object, origin: str = "the decorator") -> None:
        """Register ``engine_cls`` as ``name`` unless that would replace another class."""
        engine_cls = cls._checked_engine_class(name, engine_cls)
        existing = cls._registry.get(name)
        if existing is not None and existing is not engine_cls:
            raise BackendRegistrationError(
                f"backend {name!r} is already registered to "
                f"{existing.__module__}.{existing.__qualname__}; refusing to replace it with "
                f"{engine_cls.__module__}.{engine_cls.__qualname__} (from {origin}). "
                "Pick another name."
            )
        cls._registry[name] = engine_cls
        cls._broken.pop(name, None)

    @staticmethod
    def _checked_engine_class(name: str, engine_cls: object) -> type[CheckpointEngine]:
        from weightsync_core.api.engine import CheckpointEngine

        if not (isinstance(engine_cls, type) and issubclass(engine_cls, CheckpointEngine)):
            raise BackendRegistrationError(
                f"backend {name!r}: {engine_cls!r} is not a subclass of "
                "weightsync_core.CheckpointEngine; only engine classes can be registered"
            )
        return engine_cls
