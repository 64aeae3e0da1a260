"""The import paths of core's modules before they moved into their layer's folder (0.18).

``import weightsync_core.manager`` (or any module below) keeps working for one minor version:
it warns with a :class:`DeprecationWarning` naming the new path and gives the module that
now lives there, the same object, so patching either name patches both.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

MOVED = {
    **{name: f"api.{name}" for name in (
        "errors", "dtypes", "conversion", "config", "options", "registry", "plugins",
        "protocols")},
    **{name: f"net.{name}" for name in (
        "wire", "channel", "sealed_store", "process_group", "gloo_listener", "transport",
        "blocking")},
    **{name: f"data.{name}" for name in (
        "bucketing", "verification", "sync_layout", "topology", "devices", "delta", "shards")},
    "base": "api.engine",
    **{name: f"orchestration.{name}" for name in (
        "manager", "stages", "blame", "ray_group", "deployment", "local_ray", "delta_ledger")},
}
"""Old module name under ``weightsync_core`` -> its path under ``weightsync_core`` now
(``weightsync_core.worker``, once a module, is now the worker layer's package and exports
the same names)."""

_PACKAGE = "weightsync_core"


def _new_name(fullname: str) -> str | None:
    """The module's name now, if ``fullname`` is an old path (or a module below one)."""
    if not fullname.startswith(_PACKAGE + "."):
        return None
    first, _, rest = fullname[len(_PACKAGE) + 1 :].partition(".")
    if first not in MOVED:
        return None
    return ".".join(filter(None, (_PACKAGE, MOVED[first], rest)))


class _Alias(importlib.abc.Loader):
    """Gives the module at its new path for its old name."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the alias's spec on the module: give it back its own
        module.__spec__ = self.own_spec


class _OldPaths(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = _new_name(fullname)
        if new is None:
            return None
        warnings.warn(
            f"{fullname} moved to {new} in weightsync-core 0.18; import it from there (or "
            "the public names from weightsync_core / weightsync_core.spi): the old path goes "
            "in 0.19", DeprecationWarning, stacklevel=2)
        is_package = importlib.util.find_spec(new)
        return importlib.machinery.ModuleSpec(
            fullname, _Alias(new),
            is_package=bool(is_package and is_package.submodule_search_locations))


def install() -> None:
    """Serve the old paths (once per process)."""
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        # first: the path finder would load an old package's submodules a second time
        sys.meta_path.insert(0, _OldPaths())
