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

Where verl's engine cannot start on this machine, stand-ins are applied, each only where
it is needed and only inside the engine's module (nothing else in the process sees them):

- without CUDA: the module's ``import cupy`` (verl's NIXL engine imports it and uses it only
  on GPUs) gets an empty module where cupy is not installed; the module's ``torch`` drops
  ``pin_memory`` (pinning needs the driver) and its ``torch.cuda.synchronize()`` waits for
  no device (:class:`_CpuTorch`);
- where neither vLLM nor SGLang is installed: ``from vllm.distributed.utils import
  StatelessProcessGroup`` (verl's Mooncake engine) gets
  :class:`weightsync_verl.stateless_group.StatelessProcessGroup`, which is sealed with the
  sync's session key and decodes no pickle; the engine's ``init_process_group`` hands it the
  sync's key and timeout;
- without an RDMA device (``/sys/class/infiniband`` empty): a Mooncake ``TransferEngine``
  initialized with protocol ``rdma`` (verl's Mooncake engine opens nothing else) uses
  ``tcp`` (:class:`_TcpTransferEngine`).
"""

from __future__ import annotations

import builtins
import functools
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from weightsync_core.verl_compat import CheckpointEngine
from weightsync_verl import stateless_group

__all__ = ["VERL_BASE_IMPORT", "WEIGHTSYNC_BASE_IMPORT", "load_on_weightsync", "verl_source"]

VERL_BASE_IMPORT = "from verl.checkpoint_engine.base import"
"""The import line engines written for verl begin with."""

WEIGHTSYNC_BASE_IMPORT = "from weightsync_core.verl_compat import"
"""What it becomes."""

_VLLM_GROUP_MODULE = "vllm.distributed.utils"
_RDMA_DEVICES = Path("/sys/class/infiniband")


def verl_source(module: str) -> tuple[Path, str]:
    """The path and text of ``verl.checkpoint_engine.<module>`` in the installed verl."""
    spec = importlib.util.find_spec("verl.checkpoint_engine")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("verl is not installed: pip install verl")
    path = Path(spec.origin).parent / f"{module}.py"
    return path, path.read_text()


def load_on_weightsync(module: str) -> types.ModuleType:
    """Run verl's ``verl.checkpoint_engine.<module>`` with its base import changed to
    weightsync's, as module ``weightsync_verl.on_weightsync.<module>`` (once per process),
    with the stand-ins this machine needs (see the module); returns the module.

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
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    if spec is None:
        raise ImportError(f"cannot make a module spec for {name}")
    engine_module = importlib.util.module_from_spec(spec)
    engine_module.__file__ = str(path)
    stand_ins = _stand_in_modules()
    vars(engine_module)["__builtins__"] = {**vars(builtins), "__import__": _importer(stand_ins)}
    sys.modules[name] = engine_module
    try:
        code = compile(text.replace(VERL_BASE_IMPORT, WEIGHTSYNC_BASE_IMPORT), str(path), "exec")
        exec(code, engine_module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    if not torch.cuda.is_available():
        engine_module.torch = _CpuTorch()  # pyright: ignore[reportAttributeAccessIssue]
    if _VLLM_GROUP_MODULE in stand_ins:
        _hand_groups_their_sync(engine_module)
    if hasattr(engine_module, "TransferEngine") and not _has_rdma_device():
        engine_module.TransferEngine = functools.partial(  # pyright: ignore[reportAttributeAccessIssue]
            _TcpTransferEngine, engine_module.TransferEngine
        )
    return engine_module


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules without a spec
        return True


def _stand_in_modules() -> dict[str, types.ModuleType]:
    """The modules an engine module imports that this machine lacks, by name."""
    stand_ins: dict[str, types.ModuleType] = {}
    if not torch.cuda.is_available() and not _installed("cupy"):
        stand_ins["cupy"] = types.ModuleType("cupy")
    if not _installed("vllm") and not _installed("sglang"):
        stand_ins[_VLLM_GROUP_MODULE] = stateless_group
    return stand_ins


def _importer(stand_ins: dict[str, types.ModuleType]) -> Callable[..., Any]:
    """``__import__`` for an engine module: ``stand_ins`` by name, everything else as
    usual."""

    def import_(name: str, globals_: Any = None, locals_: Any = None,
                fromlist: Any = (), level: int = 0) -> Any:
        if level == 0 and name in stand_ins:
            return stand_ins[name]
        return builtins.__import__(name, globals_, locals_, fromlist, level)

    return import_


def _hand_groups_their_sync(engine_module: types.ModuleType) -> None:
    """Wrap ``init_process_group`` of the engines ``engine_module`` defines so that the
    stand-in groups they create belong to the running sync (its key and timeout)."""
    for engine_cls in vars(engine_module).values():
        if (inspect.isclass(engine_cls) and issubclass(engine_cls, CheckpointEngine)
                and engine_cls.__module__ == engine_module.__name__
                and "init_process_group" in vars(engine_cls)):
            engine_cls.init_process_group = _in_membership(engine_cls.init_process_group)


def _in_membership(init_process_group: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(init_process_group)
    def wrapper(self: CheckpointEngine, *args: Any, **kwargs: Any) -> Any:
        member = stateless_group.Membership(self.session_key, self.timeout,
                                            type(self).__name__)
        with stateless_group.membership(member):
            return init_process_group(self, *args, **kwargs)

    return wrapper


def _has_rdma_device() -> bool:
    return _RDMA_DEVICES.is_dir() and any(_RDMA_DEVICES.iterdir())


class _TcpTransferEngine:
    """A Mooncake ``TransferEngine`` on a machine without an RDMA device: initialized with
    protocol ``rdma``, it uses ``tcp``; everything else is the engine's own."""

    def __init__(self, transfer_engine_cls: Callable[[], Any]) -> None:
        self._engine = transfer_engine_cls()

    def initialize(self, host: str, metadata_server: str, protocol: str,
                   device_name: str) -> int:
        """The engine's ``initialize``, with ``tcp`` for ``rdma``."""
        return self._engine.initialize(host, metadata_server,
                                       "tcp" if protocol == "rdma" else protocol, device_name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


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
