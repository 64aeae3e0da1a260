"""verl's own checkpoint engines on weightsync, with only their import line changed.

:func:`load_on_weightsync` reads an engine module of the installed verl
(``verl/checkpoint_engine/<module>.py``), changes its one import of verl's base::

    -from verl.checkpoint_engine.base import ...
    +from weightsync_core.verl_compat import ...

and runs it as a module of its own. The engine registers in weightsync's registry (as
``verl_<name>``, and under its own name where no weightsync backend holds it: see
:mod:`weightsync_core.verl_compat`), so weightsync's manager, workers and conformance suite
drive it. Nothing else of verl's source changes and nothing of it is stored here: the text is
the installed verl's.

On a machine without CUDA, verl's NIXL engine needs two stand-ins, applied only there: its
module imports ``cupy`` (unused with ``device="cpu"``), which gets an empty module where it
is not installed; and it allocates its CPU buckets with ``pin_memory=True`` and calls
``torch.cuda.synchronize()`` after every bucket, both of which need a CUDA driver: the
module's ``torch`` drops ``pin_memory`` and waits for no device (:class:`_CpuTorch`).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import torch

__all__ = ["VERL_BASE_IMPORT", "WEIGHTSYNC_BASE_IMPORT", "load_on_weightsync", "verl_source"]

VERL_BASE_IMPORT = "from verl.checkpoint_engine.base import"
"""The import line engines written for verl begin with."""

WEIGHTSYNC_BASE_IMPORT = "from weightsync_core.verl_compat import"
"""What it becomes."""


def verl_source(module: str) -> tuple[Path, str]:
    """The path and text of ``verl.checkpoint_engine.<module>`` in the installed verl."""
    spec = importlib.util.find_spec("verl.checkpoint_engine")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("verl is not installed: pip install verl")
    path = Path(spec.origin).parent / f"{module}.py"
    return path, path.read_text()


def load_on_weightsync(module: str) -> types.ModuleType:
    """Run verl's ``verl.checkpoint_engine.<module>`` with its base import changed to
    weightsync's, as module ``weightsync_verl.on_weightsync.<module>`` (once per process);
    returns the module.

    Raises:
        ValueError: the module does not import verl's base exactly once (another verl
            release: the one import line to change is not there).
    """
    name = f"weightsync_verl.on_weightsync.{module}"
    if name in sys.modules:
        return sys.modules[name]
    path, text = verl_source(module)
    if text.count(VERL_BASE_IMPORT) != 1:
        raise ValueError(
            f"{path} imports verl's base {text.count(VERL_BASE_IMPORT)} times, not once: "
            f"this verl release's engine cannot run with only {VERL_BASE_IMPORT!r} changed"
        )
    cuda = torch.cuda.is_available()
    if not cuda and importlib.util.find_spec("cupy") is None:
        sys.modules.setdefault("cupy", types.ModuleType("cupy"))
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    if spec is None:
        raise ImportError(f"cannot make a module spec for {name}")
    engine_module = importlib.util.module_from_spec(spec)
    engine_module.__file__ = str(path)
    sys.modules[name] = engine_module
    try:
        code = compile(text.replace(VERL_BASE_IMPORT, WEIGHTSYNC_BASE_IMPORT), str(path), "exec")
        exec(code, engine_module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    if not cuda:
        engine_module.torch = _CpuTorch()  # pyright: ignore[reportAttributeAccessIssue]
    return engine_module


class _CpuCuda:
    """``torch.cuda`` where no CUDA device exists: ``synchronize`` waits for nothing."""

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """No device, nothing to wait for."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch:
    """``torch`` for an engine module on a machine without CUDA: ``zeros`` ignores
    ``pin_memory`` (pinning needs the driver) and ``cuda.synchronize`` returns at once."""

    cuda = _CpuCuda()

    @staticmethod
    def zeros(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)
