"""The rollout side of a sync in one process: :class:`CheckpointEngineWorker` owns the engine
and feeds what it receives to the inference server's adapter, counted and checked."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

import torch

from weightsync_core.api.config import (
    ADAPTER_CHECK,
    ADAPTER_KEEP,
    BEGIN_SYNC,
    BUILT_SETTINGS,
    DELTA_HELD,
    CheckpointEngineConfig,
)
from weightsync_core.api.engine import CheckpointEngine, CheckpointEngineWithCache
from weightsync_core.api.errors import WeightSyncError
from weightsync_core.api.passes import passes_of
from weightsync_core.api.protocols import PreparedSwitch, ServerAdapter
from weightsync_core.data.adapters import AdapterSpec
from weightsync_core.data.delta import DeltaPlan, DeltaReceiver
from weightsync_core.data.verification import ManifestGuard
from weightsync_core.worker.adapters import RolloutAdapters
from weightsync_core.worker.delivery import deliver_weights
from weightsync_core.worker.lifecycle import (
    AbortGate,
    begin_sync,
    build_engine,
    built_settings,
    engine_after_abort,
    execute_engine_method,
    written_for_verl,
)
from weightsync_core.worker.staging import (
    StagedWeights,
    prepare_switch,
    stage_weights,
    switch_paused,
)

__all__ = ["CheckpointEngineWorker"]

logger = logging.getLogger(__name__)

AdapterT = TypeVar("AdapterT")


async def _owned_copies(
    weights: AsyncIterator[tuple[str, torch.Tensor]],
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """``weights`` as tensors of their own (an engine written for verl yields views of its
    buffers, which its next bucket overwrites while the server may still hold them)."""
    async for name, tensor in weights:
        yield name, tensor.clone()


class CheckpointEngineWorker:
    """Rollout-side Ray actor: owns an engine and hands received weights to the server.

    Use as ``ray.remote(CheckpointEngineWorker).remote(config, server_adapter)``. The adapter
    (or a subclass that sets ``self.server_adapter``) receives ``update_weights(weights_iter,
    global_steps)``. ``custom_backend_module`` is imported in this process before the
    backend is resolved. ``engine``: an engine its owner built instead (a verl rollout worker
    whose weights go through this one: ``weightsync_verl.StagingCheckpointEngineWorker``).

    A sync either loads into the server as it arrives (:meth:`update_weights`: the server
    is paused for all of it), or in two phases: :meth:`stage_weights` receives and checks it
    whole while the server serves its version, :meth:`commit_staged` hands it over (the
    server paused for that step only) and rolls back to the version it served where that
    fails (:mod:`weightsync_core.worker.staging` says what each keeps). A server adapter
    with ``swap_weights(tensors, version) -> previous tensors`` (all or nothing) commits by
    adopting the staged tensors as its weights, with no copy; its old tensors are the copy
    to roll back to. A server adapter with ``prepare_weights(tensors, version)`` builds its
    switch to a complete stage in phase 1, off the pause
    (:class:`~weightsync_core.api.protocols.PreparedSwitch`); the commit applies it.

    Attributes:
        weights_version: ``global_steps`` of the last complete update (``None`` before one).
        update_complete: False while an update is running or after one failed part-way.
    """

    def __init__(
        self, config: CheckpointEngineConfig, server_adapter: ServerAdapter | None = None,
        engine: CheckpointEngine | None = None,
    ) -> None:
        self.config = config
        self.checkpoint_engine = engine if engine is not None else build_engine(config)
        self._aborts = AbortGate()
        self.server_adapter = server_adapter
        self.weights_version: int | None = None
        self.update_complete = True
        self.manifest_guard = ManifestGuard()
        self.delta_receiver = DeltaReceiver()
        self.adapters = RolloutAdapters()
        """The LoRA adapters its server holds, by name (:meth:`update_weights` with
        ``adapter``)."""
        self.staged: StagedWeights | None = None
        """The staged update (:meth:`stage_weights`), until committed or discarded."""
        self.rollback_copy: StagedWeights | None = None
        """A private copy of the version the server serves, from the last staged commit
        (None before one, and after a sync loaded as it arrived)."""
        self.replaced_copy: StagedWeights | None = None
        """The copy of the version the last staged commit replaced, until every worker of the
        replica took its stage (:meth:`forget_replaced`) or the next stage
        (:meth:`roll_back_commit`: another worker of the replica failed to take its stage)."""
        self._replaced_manifest: dict[str, Any] | None = None
        """The manifest reference before the last swap commit (a roll-back restores it: the
        tensors a server swaps out need not be what syncs send, as a tensor-parallel
        server's slices)."""

    def server_adapter_of(self, kind: type[AdapterT]) -> AdapterT:
        """This worker's server adapter, which must be a ``kind``.

        Raises:
            TypeError: it is something else (or there is none), naming both.
        """
        adapter = self.server_adapter
        if not isinstance(adapter, kind):
            raise TypeError(f"{type(self).__name__} works through a {kind.__name__}, but its "
                            f"server adapter is {type(adapter).__name__}")
        return adapter

    async def _abort_engine(self) -> None:
        self.checkpoint_engine = await engine_after_abort(self.checkpoint_engine, self.config)

    async def execute_checkpoint_engine(self, method: str, **kwargs: Any) -> Any:
        """Run one engine method (``prepare``, ``init_process_group``, ``finalize``, ...);
        :data:`~weightsync_core.api.config.BUILT_SETTINGS` answers what this process's engine
        was built with (:func:`built_settings`),
        :data:`~weightsync_core.api.config.BEGIN_SYNC` begins a sync in one call
        (:func:`begin_sync`), :data:`~weightsync_core.api.config.DELTA_HELD`
        the delta version this worker holds a copy of."""
        if method == "abort" and not kwargs:
            await self._aborts.run(self._abort_engine)
            return None
        await self._aborts.settled()
        if method == BUILT_SETTINGS and not kwargs:
            return built_settings(self.config, self.checkpoint_engine)
        if method == BEGIN_SYNC:
            return await begin_sync(
                self.execute_checkpoint_engine,
                lambda: built_settings(self.config, self.checkpoint_engine), **kwargs)
        if method == DELTA_HELD and not kwargs:
            return {"version": self.delta_receiver.version, "needs_base": False}
        if method == DELTA_HELD and set(kwargs) == {"adapter"}:
            return {"version": self.adapters.delta_held(kwargs["adapter"]), "needs_base": False}
        if method == ADAPTER_CHECK:
            self.adapters.check(AdapterSpec.from_dict(kwargs["adapter"]), self.server_adapter,
                                bool(kwargs.get("allow_change")), "this rollout worker")
            return None
        if method == ADAPTER_KEEP:
            await self.adapters.keep(self.server_adapter, kwargs["name"], kwargs["versions"])
            return None
        if method == "prepare":
            self._declare_layout(whole=kwargs.pop("adapter", None) is not None)
        return await execute_engine_method(self.checkpoint_engine, method, kwargs)

    def _declare_layout(self, whole: bool = False) -> None:
        """Hand the engine what this worker's server needs (its adapter's optional
        ``weight_layout()``: a :data:`~weightsync_core.data.shards.LayoutSpec`, None for every
        tensor whole; ``whole``, a LoRA adapter sync: None) where the engine delivers
        layouts. An adapter whose ``takes_whole_weights`` is true (a vLLM tensor-parallel
        worker, whose loaders keep its shard of a whole tensor) receives every tensor whole
        from other engines.

        Raises:
            WeightSyncError: the server needs only part of the weights, but the engine
                delivers every tensor whole.
        """
        declare = getattr(self.server_adapter, "weight_layout", None)
        layout = declare() if declare is not None else None
        engine = self.checkpoint_engine
        if getattr(engine, "executes_layouts", False):
            engine.declare_layout(None if whole else layout)
        elif layout is not None and not getattr(self.server_adapter, "takes_whole_weights",
                                                False):
            raise WeightSyncError(
                f"{type(self.server_adapter).__name__} needs only part of the weights (its "
                f"weight_layout() is {layout!r}), but backend {self.config.backend!r} delivers "
                "every tensor whole; use backend 'gloo_sharded', 'nixl_sharded' or "
                "'mooncake_sharded'")

    async def update_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        delta_base: str | None = None, delta_version: str | None = None,
        adapter: dict[str, Any] | None = None,
    ) -> dict[str, float]:
        """Receive one version of the weights and load it into the server. Unless
        ``allow_manifest_change``, a tensor whose name, shape or dtype differs from the
        previous update's is refused (:class:`~weightsync_core.api.errors.ManifestChangedError`).

        ``delta_version`` (a delta-enabled sync, from the manager): keep a host copy of what
        arrives as that version; with ``delta_base``, what arrives are patches against the
        version of that token, which this worker must hold
        (:class:`~weightsync_core.data.delta.DeltaReceiver`).

        ``adapter`` (an adapter sync: the actor's
        :class:`~weightsync_core.data.adapters.AdapterSpec` as plain data): what arrives is
        version ``global_steps`` of that LoRA adapter, added beside the versions the server
        serves (:meth:`RolloutAdapters.receive
        <weightsync_core.worker.adapters.RolloutAdapters.receive>`); the weights it serves
        and any stage are left as they are."""
        engine = self.checkpoint_engine
        passes = passes_of(engine)
        passes.clear()
        plan = DeltaPlan.from_arguments(delta_base, delta_version)
        if adapter is not None:
            if global_steps is None:
                raise WeightSyncError("an adapter sync needs a version: pass global_steps")
            stats = await self.adapters.receive(engine, self.server_adapter,
                                                AdapterSpec.from_dict(adapter), global_steps,
                                                plan)
            return {**stats, **passes.as_dict()}
        self._drop_stage()  # this version is newer than any stage
        weights = self.delta_receiver.received(engine, global_steps, plan,
                                               in_place=self._patchable_weights(plan))
        stats = await self._load(weights, global_steps, allow_manifest_change)
        if plan is not None:
            stats.update(self.delta_receiver.last_stats.as_dict())
        stats.update(passes.as_dict())
        return stats

    async def update_weights_from_cache(
        self, global_steps: int | None = None, allow_manifest_change: bool = False
    ) -> dict[str, float]:
        """Load the actor side's cached latest weights (engines with a cache only)."""
        engine = self.checkpoint_engine
        if not isinstance(engine, CheckpointEngineWithCache):
            raise WeightSyncError(
                f"backend {self.config.backend!r} keeps no cache of the latest weights; "
                "new replicas get them from the next update_weights"
            )
        self.discard_staged()
        self.delta_receiver.forget()
        return await self._load(engine.get_weights(), global_steps, allow_manifest_change)

    async def stage_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        delta_base: str | None = None, delta_version: str | None = None,
        prepare: bool = True,
    ) -> dict[str, float]:
        """Phase 1 of a staged sync: receive one version of the weights whole and check it
        (each bucket's checksum in the engine, every tensor against the previous manifest as
        in :meth:`update_weights`, a delta sync's rebuilt tensors against the sender's
        digests) into a stage the server does not read; the server serves its version
        throughout, untouched. A stage not yet committed is replaced. Arguments as for
        :meth:`update_weights`; a delta sync patches a private copy of the last version,
        never the server's own tensors.

        Each tensor is also offered to the server adapter's optional
        ``check_staged_weight`` (:class:`~weightsync_core.api.protocols.ServerAdapter`), and
        the complete stage to its optional ``prepare_weights``, which builds the server's
        switch to it (``prepare_seconds``, ``prepared_bytes`` in the figures), unless
        ``prepare`` is False (the commit then loads the stage through ``update_weights``:
        for a server already taking an update it did not start from the stage, such as
        vLLM's trainer-driven one).

        Raises:
            WeightSyncError: what :meth:`update_weights` raises before loading; the server
                serves its version and nothing is staged.
        """
        self._drop_stage()  # this version is newer; the delta copy, if any, still holds its
        self.forget_replaced()  # version, verified: the sender may patch against it
        engine = self.checkpoint_engine
        passes = passes_of(engine)
        passes.clear()
        plan = DeltaPlan.from_arguments(delta_base, delta_version)
        if plan is not None:
            self.delta_receiver.detach_from_server()
        weights = self.delta_receiver.received(engine, global_steps, plan)
        if written_for_verl(engine):
            weights = _owned_copies(weights)
        self.manifest_guard.start(allow_change=allow_manifest_change)
        start = time.perf_counter()
        staged = await stage_weights(weights, global_steps, self.manifest_guard,
                                     engine.progress,
                                     getattr(self.server_adapter, "check_staged_weight", None))
        stats: dict[str, float] = {"num_tensors": len(staged), "nbytes": staged.nbytes,
                                   "seconds": time.perf_counter() - start}
        prepare_weights = getattr(self.server_adapter, "prepare_weights", None)
        if prepare and prepare_weights is not None:
            stats.update(await prepare_switch(staged, prepare_weights, engine.progress))
        self.staged = staged
        if plan is not None:
            stats.update(self.delta_receiver.last_stats.as_dict())
        stats.update(passes.as_dict())
        return stats

    async def commit_staged(self) -> dict[str, float]:
        """Phase 2: hand the staged version to the server (the caller pauses it around this
        call) and keep it as the copy to roll back to. Where the server fails to take it,
        it gets back the version it served (from :attr:`rollback_copy`) and serves that;
        without such a copy (no staged commit before), it holds a mix of versions and
        refuses to serve, as after a failed :meth:`update_weights`.

        Raises:
            WeightSyncError: nothing is staged, or the server failed to take the stage
                (saying whether it was rolled back, and to which version).
        """
        staged = self.staged
        if staged is None:
            raise WeightSyncError(
                "this rollout worker has no staged weights to commit: stage_weights must "
                "succeed first (a failed or discarded stage leaves none)")
        self.staged = None
        if staged.prepared is not None:
            return self._apply_prepared(staged, staged.prepared)
        swap = getattr(self.server_adapter, "swap_weights", None)
        if swap is not None:
            return self._swap_in(staged, swap)
        previous = self.rollback_copy
        try:
            stats = await self._load(staged.handed_over(), staged.version, True)
        except BaseException as error:  # a cancelled commit rolls back too
            rolled_back = await self._roll_back(previous)
            if not isinstance(error, Exception):
                raise
            raise WeightSyncError(
                f"the server failed to take staged version {staged.version}: {error}; "
                + (f"it was rolled back to version {self.weights_version}, which it serves"
                   if rolled_back else "it holds a mix of versions and refuses to serve "
                   "until a sync completes (there was no copy of its version to roll back "
                   "to)")) from error
        self.rollback_copy, self.replaced_copy = staged, previous
        return stats

    async def switch_to_staged(self, mode: str = "keep", timeout_seconds: float | None = None
                               ) -> dict[str, float]:
        """Phase 2 for a replica of this one worker, in one call: pause the server
        (:meth:`pause_generation`), commit the stage (:meth:`commit_staged`: rolled back
        where the server fails to take it), and resume it unless it holds a mix of
        versions; the pause covers only this process's own work. Returns the commit's stats
        and ``paused_seconds``. ``timeout_seconds``: the pause and the commit may take that
        long together (:func:`~weightsync_core.worker.staging.switch_paused`).

        Raises:
            WeightSyncError: what :meth:`commit_staged` raises (the server resumed on the
                version it served where it was rolled back), or the switch ran past
                ``timeout_seconds`` (given up, the server resumed on its version).
        """
        try:
            stats = await switch_paused(lambda: self.pause_generation(mode), self.commit_staged,
                                        self.resume_generation, lambda: self.update_complete,
                                        timeout_seconds)
        except WeightSyncError:
            self.discard_staged()  # given up before the commit took it: the sync failed
            raise
        self.forget_replaced()  # no other worker of its replica can fail: nothing to undo
        return stats

    def forget_replaced(self) -> None:
        """Drop the copy of the version the last commit replaced: every worker of the
        replica took its stage (the manager says so), so no roll-back will need it."""
        replaced, self.replaced_copy = self.replaced_copy, None
        if replaced is not None:
            replaced.release()

    def _apply_prepared(self, staged: StagedWeights, prepared: PreparedSwitch
                        ) -> dict[str, float]:
        """Commit ``staged`` by applying the switch its server prepared in phase 1 (all or
        nothing); the applied switch is kept to undo it (:meth:`roll_back_commit`) until the
        replica's commit is known, and the stage's tensors are dropped."""
        start = time.perf_counter()
        try:
            prepared.apply()
        except Exception as error:
            staged.release()
            self.delta_receiver.forget()  # it holds the version the server refused
            raise WeightSyncError(
                f"the server failed to switch to staged version {staged.version}: {error!r}; "
                f"it kept version {self.weights_version}, which it serves") from error
        self._took_whole(staged, StagedWeights(self.weights_version, prepared=prepared))
        return {"num_tensors": float(len(staged)),
                "nbytes": float(staged.nbytes - prepared.nbytes),
                "seconds": time.perf_counter() - start}

    def _swap_in(self, staged: StagedWeights,
                 swap: Callable[[dict[str, torch.Tensor], int | None], dict[str, torch.Tensor]],
                 ) -> dict[str, float]:
        """Commit ``staged`` by the server adopting its tensors as its weights (its
        adapter's ``swap_weights``: all or nothing); the tensors it served become the copy
        to roll the commit back to, at no cost in memory."""
        start = time.perf_counter()
        try:
            served = swap(dict(staged.tensors), staged.version)
        except Exception as error:
            self.delta_receiver.forget()  # it holds the version the server refused
            raise WeightSyncError(
                f"the server failed to take staged version {staged.version}: {error}; it "
                f"kept version {self.weights_version}, which it serves") from error
        self._took_whole(staged, StagedWeights(self.weights_version, list(served.items())))
        return {"num_tensors": float(len(staged)), "nbytes": float(staged.nbytes),
                "seconds": time.perf_counter() - start}

    def _took_whole(self, staged: StagedWeights, replaced: StagedWeights) -> None:
        """After a commit that is all or nothing (a swap, a prepared switch): ``staged`` is
        served, ``replaced`` undoes it, and there is no copy to repair a failed one from."""
        self.replaced_copy, self.rollback_copy = replaced, None
        self._replaced_manifest = self.manifest_guard.reference
        self._accept_manifest(staged)
        self.weights_version = staged.version

    def _accept_manifest(self, staged: StagedWeights) -> None:
        """Make ``staged``'s names, shapes and dtypes the reference the next sync is checked
        against (it was checked against the last one when it was staged)."""
        self.manifest_guard.start(allow_change=True)
        for name, tensor in staged:
            self.manifest_guard.check(name, tensor)
        self.manifest_guard.accept()

    async def roll_back_commit(self) -> None:
        """Undo this worker's last commit, which its server took (another worker of its
        replica failed to take its stage: a replica must not serve two versions): load the
        copy of the version it served before (:attr:`replaced_copy`).

        Raises:
            WeightSyncError: there is no such copy, or the server failed to take it (it then
                holds a mix of versions and refuses to serve).
        """
        previous, self.replaced_copy = self.replaced_copy, None
        if previous is None:
            raise WeightSyncError("this rollout worker has no copy of the version before its "
                                  "last commit to roll back to")
        swap = getattr(self.server_adapter, "swap_weights", None)
        if previous.prepared is not None or swap is not None:  # all or nothing: undone
            self.delta_receiver.forget()
            if previous.prepared is not None:  # the server undoes the switch it applied
                previous.prepared.undo()
                previous.release()
            elif swap is not None:  # the server adopts its old tensors again
                swap(dict(previous.tensors), previous.version)
            self.manifest_guard.restore(self._replaced_manifest)
            self.weights_version = previous.version
            return
        if not await self._roll_back(previous):
            raise WeightSyncError(f"rolling back to version {previous.version} failed: the "
                                  "server holds a mix of versions and refuses to serve")

    async def _roll_back(self, previous: StagedWeights | None) -> bool:
        """Load ``previous`` (the copy of the version the server served) into the server
        after a failed commit; whether the server is whole again. The delta copy is dropped
        either way (it holds the version that failed): the next sync is a full one."""
        self.delta_receiver.forget()
        if previous is None:
            return False
        try:
            await self._load(previous.handed_over(), previous.version, True)
        except Exception:
            logger.exception("rolling back to version %s failed", previous.version)
            return False
        self.rollback_copy = previous  # still the server's version
        return True

    def discard_staged(self) -> None:
        """Drop the staged update, if any (the server never saw it). The delta copy is
        dropped with it (it holds the staged version, which the caller gives up): the next
        sync is a full one. (A stage a newer sync replaces keeps it: that sync's patches
        may be against the staged version, which the copy holds, verified.)"""
        if self.staged is not None:
            self._drop_stage()
            self.delta_receiver.forget()

    def _drop_stage(self) -> None:
        """Forget the stage, if any, with what the server prepared for it."""
        staged, self.staged = self.staged, None
        if staged is not None:
            staged.release()

    async def _load(
        self, weights: AsyncIterator[tuple[str, torch.Tensor]], global_steps: int | None,
        allow_manifest_change: bool,
    ) -> dict[str, float]:
        self.forget_replaced()  # the server's version changes
        self.rollback_copy = None
        self.update_complete = False
        self.manifest_guard.start(allow_change=allow_manifest_change)
        if written_for_verl(self.checkpoint_engine):
            weights = _owned_copies(weights)
        engine = self.checkpoint_engine
        stats = await deliver_weights(self.server_adapter, weights, global_steps,
                                      self.manifest_guard, engine.progress, passes_of(engine))
        self.update_complete = True
        self.weights_version = global_steps
        return stats.as_dict()

    def _patchable_weights(self, plan: DeltaPlan | None) -> Mapping[str, torch.Tensor] | None:
        """The server's own tensors a delta-enabled sync may patch in place (its adapter's
        optional ``patchable_weights()``), for a full sync of such a ``plan``; else None."""
        offer = getattr(self.server_adapter, "patchable_weights", None)
        if plan is None or plan.is_delta or offer is None:
            return None
        return offer()

    def weights_status(self) -> dict[str, Any]:
        """``{"version", "complete", "delta_version", "delta_kept_bytes", "staged_version",
        "staged_bytes", "rollback_version", "rollback_bytes", "adapters"}`` of the weights
        this worker serves (``delta_version``: the token of the version it holds a copy of
        for delta syncs, or None; ``delta_kept_bytes``: the size of the copies it keeps
        itself, the server's tensors patched in place not counted), stages (None and 0 where
        nothing is staged) and could roll back to; ``adapters``: per LoRA adapter name, its
        spec and the versions its server holds (:meth:`RolloutAdapters.status
        <weightsync_core.worker.adapters.RolloutAdapters.status>`)."""
        staged, rollback = self.staged, self.rollback_copy
        return {"version": self.weights_version, "complete": self.update_complete,
                "delta_version": self.delta_receiver.version,
                "delta_kept_bytes": self.delta_receiver.kept_bytes,
                "staged_version": None if staged is None else staged.version,
                "staged_bytes": 0 if staged is None else staged.nbytes,
                "rollback_version": None if rollback is None else rollback.version,
                "rollback_bytes": 0 if rollback is None else rollback.nbytes,
                "adapters": self.adapters.status()}

    async def _adapter_call(self, method: str) -> None:
        function = getattr(self.server_adapter, method, None)
        if function is not None:
            result = function()
            if inspect.isawaitable(result):
                await result

    async def abort_all_requests(self) -> None:
        """Forward to the server adapter, if it implements it."""
        await self._adapter_call("abort_all_requests")

    async def pause_generation(self, mode: str = "keep") -> None:
        """Pause the server for the switch of a staged sync: ``keep`` (requests in flight
        freeze where they are and continue on the new weights once resumed, their KV cache
        kept), ``drain`` (they finish first; new ones wait) or ``abort`` (they end now).
        Forwarded to the adapter's ``pause_generation(mode)``; an adapter without one is
        paused with its ``abort_all_requests``."""
        pause = getattr(self.server_adapter, "pause_generation", None)
        if pause is None:
            await self._adapter_call("abort_all_requests")
            return
        result = pause(mode=mode)
        if inspect.isawaitable(result):
            await result

    async def release_kv_cache(self) -> None:
        """Forward to the server adapter, if it implements it."""
        await self._adapter_call("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        """Forward to the server adapter, if it implements it."""
        await self._adapter_call("resume_kv_cache")

    async def resume_generation(self) -> None:
        """Forward to the server adapter, if it implements it."""
        await self._adapter_call("resume_generation")

    async def sleep(self) -> None:
        """Forward to the server adapter, if it implements it."""
        await self._adapter_call("sleep")

    async def wake_up(self) -> None:
        """Forward to the server adapter, if it implements it."""
        await self._adapter_call("wake_up")
