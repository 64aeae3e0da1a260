"""LoRA adapter syncs in one rollout process: each version of an adapter received whole and
checked against its :class:`~weightsync_core.data.adapters.AdapterSpec` before the server
sees it, then added beside the versions the server serves (none of them paused or changed);
which versions the server keeps, the manager says once the sync's outcome is known.

The server adapter takes them through three methods (plain or async):

- ``load_adapter(spec, version, tensors)``: add ``version`` of adapter ``spec.name``
  (``tensors`` by PEFT's names, the server's to keep), all or nothing, beside the versions it
  holds (replacing that version where it holds it already);
- ``drop_adapter(name, version)``: stop serving that version (a server defers dropping a
  version that requests in flight use, and refuses new requests for it);
- optionally ``check_adapter(spec)``: raise where it cannot serve such an adapter (a rank
  above its maximum, a target module it does not have), so that the sync is refused before
  any byte moves.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync_core.api.engine import CheckpointEngine
from weightsync_core.api.errors import AdapterMismatchError, WeightSyncError
from weightsync_core.data.adapters import AdapterSpec
from weightsync_core.data.delta import DeltaPlan, DeltaReceiver
from weightsync_core.worker.lifecycle import written_for_verl

__all__ = ["RolloutAdapters"]


async def _call(function: Any, *args: Any) -> Any:
    result = function(*args)
    return await result if inspect.isawaitable(result) else result


@dataclass
class _Held:
    """One adapter's versions in this process, oldest first, and its delta copy."""

    spec: AdapterSpec
    versions: list[int] = field(default_factory=list)
    delta: DeltaReceiver = field(default_factory=DeltaReceiver)


class RolloutAdapters:
    """The LoRA adapters a rollout worker's server holds, by name, and how a sync adds a
    version (:meth:`receive`)."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def check(self, spec: AdapterSpec, server: Any, allow_change: bool, who: str) -> None:
        """Refuse, before any byte of its sync moves, an adapter that differs from the one
        this worker holds versions of (unless ``allow_change``) or that ``server`` cannot
        serve (its optional ``check_adapter``).

        Raises:
            AdapterMismatchError: naming both sides and what differs.
        """
        if server is None or not callable(getattr(server, "load_adapter", None)):
            raise AdapterMismatchError(
                f"{who}'s server ({type(server).__name__}) takes no adapters: its server "
                "adapter needs load_adapter(spec, version, tensors) and drop_adapter(name, "
                "version)")
        held = self._held.get(spec.name)
        if held is not None and held.versions and not allow_change:
            held.spec.check_same(spec, who, "the actor")
        check = getattr(server, "check_adapter", None)
        if check is not None:
            try:
                check(spec)
            except Exception as error:
                raise AdapterMismatchError(
                    f"{who}'s server cannot serve adapter {spec.name!r} as the actor has it "
                    f"({spec.describe()}): {error}") from error

    def delta_held(self, name: str) -> str | None:
        """The delta version of adapter ``name`` this worker holds a copy of (None: none)."""
        held = self._held.get(name)
        return None if held is None else held.delta.version

    async def receive(
        self, engine: CheckpointEngine, server: Any, spec: AdapterSpec, version: int,
        plan: DeltaPlan | None,
    ) -> dict[str, float]:
        """Receive version ``version`` of adapter ``spec`` whole, each tensor checked
        against ``spec`` (a delta sync's rebuilt tensors also against the sender's digests),
        then hand it to ``server.load_adapter``; returns ``num_tensors``, ``nbytes``,
        ``seconds`` and ``load_seconds``.

        Raises:
            AdapterMismatchError: a tensor does not fit ``spec``, or one is missing (nothing
                was loaded).
            WeightSyncError: the server refused the version (it serves what it served).
        """
        held = self._held.get(spec.name)
        if held is None or held.spec != spec:
            held = self._held[spec.name] = _Held(
                spec, held.versions if held is not None else [])
        start = loading = time.perf_counter()
        progress = engine.progress
        check = spec.tensor_check()
        tensors: dict[str, torch.Tensor] = {}
        nbytes = 0
        received = held.delta.received(engine, version, plan)
        if written_for_verl(engine):  # it yields views of buffers it reuses
            received = _owned(received)
        progress.tensors = 0
        try:
            progress.enter("receiving")
            async for name, tensor in received:
                check.check(name, tensor)
                tensors[name] = tensor
                nbytes += tensor.numel() * tensor.element_size()
                progress.tensors += 1
            check.finish()
            progress.enter("loading")
            loading = time.perf_counter()
            try:
                await _call(server.load_adapter, spec, version, tensors)
            except Exception as error:
                held.delta.forget()  # it holds the version the server refused
                raise WeightSyncError(
                    f"the server refused version {version} of adapter {spec.name!r}: "
                    f"{error!r}; it serves the versions it served") from error
        finally:
            progress.enter("idle")
        if version not in held.versions:
            held.versions.append(version)
        end = time.perf_counter()
        return {"num_tensors": float(len(tensors)), "nbytes": float(nbytes),
                "seconds": end - start, "load_seconds": end - loading}

    async def keep(self, server: Any, name: str, versions: list[int]) -> None:
        """Keep exactly ``versions`` of adapter ``name`` (the manager's ledger): the server
        drops every other version this worker added. Unknown names and versions are
        ignored (a worker that never took them)."""
        held = self._held.get(name)
        if held is None:
            return
        wanted = set(versions)
        for version in [v for v in held.versions if v not in wanted]:
            await _call(server.drop_adapter, name, version)
            held.versions.remove(version)

    def status(self) -> dict[str, dict[str, Any]]:
        """Per adapter name: its spec (plain data) and the versions held, oldest first."""
        return {name: {"spec": held.spec.as_dict(), "versions": list(held.versions)}
                for name, held in self._held.items()}


async def _owned(weights: AsyncIterator[tuple[str, torch.Tensor]]
                 ) -> AsyncIterator[tuple[str, torch.Tensor]]:
    async for name, tensor in weights:
        yield name, tensor.clone()
