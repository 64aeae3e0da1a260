"""An engine's life in one process: built from the config (its options checked here, on this
machine), its methods run off the event loop where they block, aborted or replaced after a
failed sync, and closed."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from weightsync_core.api.config import CheckpointEngineConfig
from weightsync_core.api.engine import (
    CheckpointEngine,
)
from weightsync_core.api.errors import in_stage
from weightsync_core.api.options import parse_options
from weightsync_core.api.plugins import load_custom_backend_module
from weightsync_core.api.registry import CheckpointEngineRegistry
from weightsync_core.net.blocking import run_blocking

__all__ = [
    "AbortGate",
    "begin_sync",
    "build_engine",
    "built_settings",
    "check_on_this_machine",
    "close_engine",
    "engine_after_abort",
    "execute_engine_method",
    "written_for_verl",
]

logger = logging.getLogger(__name__)

_BLOCKING_METHODS = frozenset({"init_process_group", "finalize", "abort"})


def build_engine(config: CheckpointEngineConfig) -> CheckpointEngine:
    """Import ``custom_backend_module`` in this process (under the operator's allowlist,
    this process's and the one the config carries from the driver), check what depends on
    this machine, then build the configured engine.

    ``rollout_dtype`` (when set, unless ``rollout_quantization`` is and the engine does not
    quantize itself, ``quantizes_shards``: then the actor casts while it quantizes),
    ``verify`` and ``timeout`` go to engines whose constructor takes them; an engine
    written for verl, which knows none of them, gets only
    ``bucket_size`` and its ``engine_kwargs`` and then, unless it set one of its own, the
    sync's timeout as its ``timeout`` attribute (what the helpers it uses wait at most).

    Raises:
        PluginError: a ``custom_backend_module`` refused or not loadable.
        EngineOptionsError: an option this machine cannot honour (a ``host`` that is no
            address of it, see :meth:`~weightsync_core.api.options.EngineOptions.check_local`).
        ValueError: buckets that cannot fit in this machine's memory.
    """
    load_custom_backend_module(config.custom_backend_module, config.trusted_modules)
    engine_cls = CheckpointEngineRegistry.get(config.backend)
    check_on_this_machine(engine_cls, config)
    options = {"verify": config.verify, "timeout": config.sync_timeout_seconds}
    if config.rollout_dtype is not None and (config.rollout_quantization is None
                                             or getattr(engine_cls, "quantizes_shards", False)):
        # (the actor casts a stream it quantizes: its scales stay float32)
        options["rollout_dtype"] = config.rollout_torch_dtype  # verl's take a dtype
    engine = engine_cls(
        bucket_size=config.bucket_size_bytes,
        **_accepted(engine_cls, options),
        **config.active_engine_kwargs,
    )
    if written_for_verl(engine) and "timeout" not in vars(engine):
        engine.timeout = config.sync_timeout_seconds
    return engine


def built_settings(config: CheckpointEngineConfig, engine: CheckpointEngine) -> dict[str, Any]:
    """What travels as ``engine`` was built from ``config`` in this process
    (:meth:`~weightsync_core.api.config.CheckpointEngineConfig.travel_settings`, from the engine's
    own options where it has them): what a worker answers a sync's
    :data:`~weightsync_core.api.config.BUILT_SETTINGS` call with, which the manager compares
    with its own config before any byte moves."""
    engine_cls = type(engine)
    options = getattr(engine, "options", None) if engine_cls.declares_options() else None
    return config.travel_settings(engine_cls, options)


def check_on_this_machine(
    engine_cls: type[CheckpointEngine], config: CheckpointEngineConfig
) -> None:
    """What the driver cannot check for this process, checked in it before its engine is
    built (before any byte moves): that the address it binds is one of this machine's
    (its options' :meth:`~weightsync_core.api.options.EngineOptions.check_local`) and that its
    buckets fit in this machine's memory
    (:meth:`~weightsync_core.api.config.CheckpointEngineConfig.check_bucket_memory`). An
    engine written for verl (no typed options) has its buckets checked only.

    Raises:
        EngineOptionsError: the address cannot be bound here.
        ValueError: the buckets cannot fit here.
    """
    if engine_cls.declares_options():
        parse_options(engine_cls.options_class, config.backend,
                      config.active_engine_kwargs).check_local(config.backend)
    config.check_bucket_memory(engine_cls)


def close_engine(engine: Any) -> None:
    """Release what an engine about to be replaced holds (its group, transport threads,
    listening sockets), if it has a ``close`` (an engine written for verl may not). Left to
    the garbage collector, a replaced engine keeps them for as long as anything refers to
    it, and a transport's destructor then runs wherever the last reference goes. A failure
    to close is logged: the engine is dropped either way."""
    close = getattr(engine, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception:
        logger.warning("closing the replaced %s failed", type(engine).__name__, exc_info=True)


def _accepted(engine_cls: type[CheckpointEngine], options: dict[str, Any]) -> dict[str, Any]:
    """The ``options`` that ``engine_cls``'s constructor takes."""
    parameters = inspect.signature(engine_cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return options
    return {name: value for name, value in options.items() if name in parameters}


async def execute_engine_method(engine: CheckpointEngine, method: str,
                                kwargs: dict[str, Any]) -> Any:
    """Run ``engine.<method>(**kwargs)``: a public method only, off the event loop where it
    blocks (group set-up and teardown)."""
    if method.startswith("_") or not hasattr(engine, method):
        raise AttributeError(f"{type(engine).__name__} has no public method {method!r}")
    function = getattr(engine, method)
    if method in _BLOCKING_METHODS:
        return await run_blocking(function, **kwargs)
    result = function(**kwargs)
    return await result if inspect.isawaitable(result) else result


async def begin_sync(execute: Callable[..., Awaitable[Any]], settings: Callable[[], Any],
                     key: bytes, adapter: str | None = None) -> dict[str, Any]:
    """A worker's answer to :data:`~weightsync_core.api.config.BEGIN_SYNC`: the three stages
    that begin a sync, in their order, in one call: ``execute("set_session_key", key=key)``
    (stage ``authenticate``), ``execute("address")`` and ``settings()`` (``locate``),
    ``execute("prepare")`` (``prepare``; ``execute("prepare", adapter=adapter)`` for a sync
    of that LoRA adapter through an engine that delivers layouts). ``execute`` is the
    worker's ``execute_checkpoint_engine``; an error carries the stage it was raised in
    (:func:`~weightsync_core.api.errors.failed_stage`)."""
    with in_stage("authenticate"):
        await execute("set_session_key", key=key)
    with in_stage("locate"):
        address, built = await execute("address"), settings()
    with in_stage("prepare"):
        metadata = await execute("prepare", **({} if adapter is None else {"adapter": adapter}))
    return {"address": address, "settings": built, "metadata": metadata}


def written_for_verl(engine: CheckpointEngine) -> bool:
    """Whether ``engine`` is an engine written for verl (own constructor, no typed
    options), which keeps none of weightsync's engines' guarantees about aborts and the
    memory of what it yields."""
    return not type(engine).declares_options()


class AbortGate:
    """A worker's abort of its engine after a failed sync, which its later engine calls wait
    for: the abort of an engine written for verl ends by replacing it with a new one, and a
    call of the next sync that ran meanwhile (its ``set_session_key``) went to the old one."""

    def __init__(self) -> None:
        self._running: asyncio.Future[None] | None = None

    async def run(self, abort: Callable[[], Awaitable[None]]) -> None:
        """Run ``abort()``, which the calls that :meth:`settled` meanwhile wait for."""
        running = self._running = asyncio.ensure_future(abort())
        try:
            await running
        finally:
            if self._running is running:
                self._running = None

    async def settled(self) -> None:
        """Wait for an abort still running (its outcome is its caller's)."""
        running = self._running
        if running is not None and not running.done():
            await asyncio.wait([running])


async def engine_after_abort(
    engine: CheckpointEngine, config: CheckpointEngineConfig
) -> CheckpointEngine:
    """Abort ``engine`` after a failed sync; returns the engine to use from now on.

    An engine written for verl without an ``abort`` of its own only has its ``finalize``,
    which may keep state of the failed sync (verl's NIXL engine keeps the failed sync's
    queued messages and notifications, and every later sync fails on them): it is
    finalized as far as it goes and replaced by a new one built from ``config``."""
    if not (written_for_verl(engine) and type(engine).abort is CheckpointEngine.abort):
        await run_blocking(engine.abort)
        return engine
    with contextlib.suppress(Exception):  # half-used: whatever it cannot release is dropped
        await run_blocking(engine.finalize)
    return build_engine(config)
