"""A staged update in one rollout process: the weights of a sync received whole, checked and
kept apart from the inference server while it serves its current version (phase 1), then
handed to the server in one step (phase 2), with a private copy of the version it served
to roll back to where that step fails.

Memory, in bytes of the model in its rollout dtype (M; a sharded worker's share): a stage
holds M from the end of phase 1 until it is committed or discarded. A server that loads the
stage (its adapter's ``update_weights``) gets a copy of it, and the worker keeps the stage as
the copy of the version served, to roll a later failed commit back to: M from the first
commit on. The copy of the version a commit replaced is kept until every worker of the
replica took its stage (then dropped: ``forget_replaced``): 2M at most during a commit, M
after it. A server that swaps the stage in (its adapter's ``swap_weights``: the trainer's
Hugging Face replicas) serves the stage's own tensors, and its old ones are kept only until
the replica's commit is known: M during phase 1 and the commit, nothing after, and the
commit copies nothing. A server that prepares its switch (its adapter's
``prepare_weights``: vLLM's workers) holds, besides the stage, what it prepared (its adapter
states how much: :attr:`~weightsync_core.api.protocols.PreparedSwitch.nbytes`) from the end
of phase 1 to the commit, and after the commit what undoing it needs until the replica's
commit is known; the stage is dropped at the commit. A delta-enabled sync keeps its own copy
of the last version besides (:class:`~weightsync_core.data.delta.DeltaReceiver`).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync_core.api.engine import SyncProgress
from weightsync_core.api.errors import WeightSyncError
from weightsync_core.api.protocols import PreparedSwitch
from weightsync_core.data.verification import ManifestGuard

__all__ = ["StagedWeights", "prepare_switch", "stage_weights", "switch_paused"]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class StagedWeights:
    """One version of the weights held apart from the server: every tensor of a sync in
    the order it arrived, each a tensor of its own (no engine or server writes into it).

    Attributes:
        version: the ``global_steps`` of the sync that brought it.
        tensors: ``(name, tensor)`` in arrival order.
        prepared: the server's switch to it, built off the pause (its adapter's
            ``prepare_weights``), or None; in the copy of a version a commit replaced, the
            applied switch, whose ``undo`` serves that version again (``tensors`` empty).
    """

    version: int | None
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    prepared: PreparedSwitch | None = None

    @property
    def nbytes(self) -> int:
        """Bytes it holds (a tensor's storage shared with another counted once per tensor),
        what the server prepared included."""
        prepared = 0 if self.prepared is None else self.prepared.nbytes
        return prepared + sum(_nbytes(tensor) for _, tensor in self.tensors)

    def release(self) -> None:
        """Drop what the server prepared for it, if anything (it will not be applied)."""
        prepared, self.prepared = self.prepared, None
        if prepared is not None:
            prepared.release()

    def __len__(self) -> int:
        return len(self.tensors)

    async def handed_over(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Every tensor as a copy of its own, for a server to load (it may keep or change
        what it gets; this stage stays as it was)."""
        for name, tensor in self.tensors:
            yield name, tensor.clone()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)


async def stage_weights(
    weights: AsyncIterator[tuple[str, torch.Tensor]], version: int | None,
    guard: ManifestGuard, progress: SyncProgress,
    check: Callable[[str, torch.Tensor], Any] | None = None,
) -> StagedWeights:
    """Receive the whole of ``weights`` into a :class:`StagedWeights`, each tensor checked
    against the previous sync's manifest as it arrives (``guard``: a changed tensor, a
    missing one or an empty stream is refused); the tensors must be the caller's to keep
    (what weightsync's engines and :class:`~weightsync_core.data.delta.DeltaReceiver` yield
    are). The guard's reference moves only once the stage is applied (``guard.accept()``).
    ``check(name, tensor)`` (plain or async; the server adapter's optional
    ``check_staged_weight``) may refuse a tensor by raising.
    """
    staged = StagedWeights(version)
    progress.tensors = 0
    try:
        progress.enter("receiving")
        async for name, tensor in weights:
            guard.check(name, tensor)
            if check is not None:
                progress.enter("loading")  # the server holds the tensor
                checked = check(name, tensor)
                if inspect.isawaitable(checked):
                    await checked
            staged.tensors.append((name, tensor))
            progress.tensors += 1
            progress.enter("receiving")
        guard.finish()
    finally:
        progress.enter("idle")
    return staged


async def prepare_switch(
    staged: StagedWeights, prepare: Callable[..., Any], progress: SyncProgress
) -> dict[str, float]:
    """Have the server build its switch to ``staged`` off the pause (``prepare``: its
    adapter's ``prepare_weights(tensors, version)``, plain or async), kept as
    ``staged.prepared``; returns ``prepare_seconds`` and ``prepared_bytes``.

    Raises:
        WeightSyncError: the server could not prepare it (the stage is refused in phase 1;
            the server serves its version, untouched).
    """
    start = time.perf_counter()
    try:
        progress.enter("loading")
        prepared = prepare(dict(staged.tensors), staged.version)
        if inspect.isawaitable(prepared):
            prepared = await prepared
    except WeightSyncError:
        raise
    except Exception as error:
        raise WeightSyncError(f"the server could not prepare its switch to staged version "
                              f"{staged.version}: {error!r}") from error
    finally:
        progress.enter("idle")
    staged.prepared = prepared
    return {"prepare_seconds": time.perf_counter() - start,
            "prepared_bytes": float(prepared.nbytes)}


async def switch_paused(
    pause: Callable[[], Awaitable[None]], commit: Callable[[], Awaitable[dict[str, float]]],
    resume: Callable[[], Awaitable[None]], whole: Callable[[], bool],
    timeout_seconds: float | None = None,
) -> dict[str, float]:
    """Phase 2 in one process: ``pause()``, ``commit()``, then ``resume()`` unless the
    server holds a mix of versions (``whole()`` false: a failed commit that could not roll
    back), whatever the commit raised. Returns the commit's figures and
    ``paused_seconds``.

    ``timeout_seconds``: how long the pause and the commit may take together; past it they
    are cancelled (a commit cancelled while loading rolls back, see
    :meth:`~weightsync_core.worker.rollout.CheckpointEngineWorker.commit_staged`), the
    server resumes on the version it served, and :class:`WeightSyncError` says so.
    """
    start = time.perf_counter()
    doing = "pausing the server"

    async def switch() -> dict[str, float]:
        nonlocal doing
        await pause()
        doing = "committing the stage"
        return await commit()

    try:
        stats = await asyncio.wait_for(switch(), timeout_seconds)
    except TimeoutError as error:
        raise WeightSyncError(
            f"the switch did not finish within {timeout_seconds:g} s (sync_timeout_seconds) "
            f"and was given up while {doing}: the stage was not committed, and the server "
            + ("serves the version it served" if whole() else
               "holds a mix of versions and refuses to serve until a sync completes")
        ) from error
    finally:
        if whole():
            await resume()
    return {**stats, "paused_seconds": time.perf_counter() - start}
