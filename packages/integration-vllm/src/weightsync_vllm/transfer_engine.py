"""weightsync as a vLLM weight-transfer engine (the worker side).

vLLM builds one :class:`WeightsyncTransferEngine` in each of its worker processes when the
engine is created with ``weight_transfer_config=WeightTransferConfig(backend="weightsync")``
(the ``weightsync_vllm`` plugin registers the name). ``init_weight_transfer_engine`` takes a
:class:`~weightsync_core.CheckpointEngineConfig` as a dict and builds the configured weightsync
backend (gloo, nixl, mooncake, kimi, nccl, ...) in that process; each update receives one
version of the weights over it, verified, straight into ``model.load_weights``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync_core import (
    AdapterSpec,
    CheckpointEngineConfig,
    CheckpointEngineWorker,
    WeightSyncError,
)
from weightsync_core.data.shards import Layout, LayoutSpec, resolve_layout
from weightsync_core.spi import ControlChannel, default_host
from weightsync_vllm.event_loop import EventLoopThread
from weightsync_vllm.expected_weights import ExpectedWeights, expected_weights_of
from weightsync_vllm.lora_store import LoRAStore
from weightsync_vllm.prepared_switch import PreparedVLLMSwitch, ShadowModel
from weightsync_vllm.reload import abandon_reload, finish_reload, start_reload
from weightsync_vllm.rendezvous import Arguments, Joined, RendezvousMessage
from weightsync_vllm.shard_layout import tensor_parallel_layout_spec, whole_tensor
from weightsync_vllm.stage_arguments import typed_arguments

__all__ = ["WeightsyncInitInfo", "WeightsyncTransferEngine", "WeightsyncUpdateInfo"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_STAGE_MARGIN_SECONDS = 5.0
"""Extra time a call into the engine gets beyond the sync timeout, so that the engine's own
timeout (which names the peer it waited for) fires first."""


@dataclasses.dataclass
class WeightsyncInitInfo(CheckpointEngineConfig, WeightTransferInitInfo):
    """The init info: a :class:`~weightsync_core.CheckpointEngineConfig` (its fields, as vLLM
    passes them: ``backend``, ``update_weights_bucket_megabytes``, ``engine_kwargs``,
    ``sync_timeout_seconds``, ``verify``, ...) that is also vLLM's init-info type."""


@dataclasses.dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """One update: the version it carries and whether its tensor list may differ from the
    previous update's. A trainer that drives the sync itself (vLLM's trainer-side API,
    :class:`~weightsync_vllm.trainer_engine.WeightsyncTrainerEngine`) adds where its
    rendezvous inbox is (``trainer_inbox``) and the sync's fresh secret (``session_key``,
    hex); without them the sync's stages come from weightsync's manager."""

    global_steps: int | None = None
    allow_manifest_change: bool = False
    trainer_inbox: str | None = None
    session_key: str | None = None
    delta_base: str | None = None
    delta_version: str | None = None


def _receiver_rank(parallel_config: Any) -> int:
    """This vLLM worker's rank among the receivers of a trainer-driven sync: its global rank
    across data-parallel replicas, as vLLM indexes a per-worker update info."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return parallel_config.data_parallel_index * parallel_config.world_size + rank


@runtime_checkable
class _LoadsWeights(Protocol):
    """A vLLM model (vLLM types the engine's target model as a plain ``torch.nn.Module``)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


async def _each(tensors: dict[str, torch.Tensor]) -> AsyncIterator[tuple[str, torch.Tensor]]:
    for item in tensors.items():
        yield item


class _ModelLoader:
    """The server adapter of a vLLM worker: hands each received tensor to
    ``model.load_weights`` of the engine's current target model, after checking it against
    what the model holds (when that is known); a stream that missed one of the model's
    tensors fails at its end.

    A worker of a tensor-parallel engine declares the slices it needs (:meth:`weight_layout`)
    to backends that deliver layouts, and rebuilds each received piece into a tensor of the
    checkpoint's shape for ``load_weights``, which keeps exactly that piece; from other
    backends it takes every tensor whole (``takes_whole_weights``).

    LoRA adapter syncs go to the engine's :class:`~weightsync_vllm.lora_store.LoRAStore`
    (``check_adapter``, ``load_adapter``, ``drop_adapter``); the model is not touched."""

    takes_whole_weights = True

    def __init__(self, engine: WeightsyncTransferEngine) -> None:
        self.engine = engine
        self.load_seconds = 0.0
        """Seconds the last update spent in ``load_weights``."""
        self.reloads = False
        """Whether an update runs vLLM's layerwise reload itself (a staged commit, or its
        roll-back: no ``start_weight_update`` / ``finish_weight_update`` around them)."""

    def check_staged_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Refuse, while it is staged, a whole tensor the model does not hold with that
        name, shape and dtype (what :meth:`update_weights` would refuse at the commit)."""
        expected = self.engine.expected_weights()
        if expected is not None and self._needed_boxes(expected) is None:
            expected.check(name, tensor)

    def check_adapter(self, spec: AdapterSpec) -> None:
        """Refuse an adapter vLLM cannot serve (:meth:`LoRAStore.check`)."""
        self.engine.adapters.check(spec)

    def load_adapter(self, spec: AdapterSpec, version: int,
                     tensors: dict[str, torch.Tensor]) -> None:
        """Add ``version`` of adapter ``spec.name`` to vLLM, in memory
        (:meth:`LoRAStore.load`)."""
        self.engine.adapters.load(spec, version, tensors)

    def drop_adapter(self, name: str, version: int) -> None:
        """Stop serving ``version`` of adapter ``name`` (:meth:`LoRAStore.drop`: vLLM lets
        go of it once no request in flight uses it)."""
        self.engine.adapters.drop(name, version)

    def weight_layout(self) -> LayoutSpec | None:
        """This worker's slices of a Qwen2/Llama model under tensor parallelism (None: every
        tensor whole; also where the checkpoint's shapes are unknown, since the loader
        rebuilds whole tensors from them)."""
        if self.engine.expected_weights() is None:
            return None
        return self.engine.layout_spec()

    def _needed_boxes(self, expected: ExpectedWeights | None) -> Layout | None:
        """The boxes this sync delivers, where the engine delivers the declared layout."""
        spec = self.weight_layout()
        if (expected is None or spec is None
                or not getattr(self.engine.worker.checkpoint_engine, "executes_layouts", False)):
            return None
        return resolve_layout(spec, expected.shapes(), "this vLLM worker")

    async def update_weights(
        self, weights: AsyncIterator[tuple[str, torch.Tensor]], global_steps: int | None = None
    ) -> None:
        if not self.reloads:
            await self._load(weights)
            return
        start_reload(self.engine.model)
        try:
            await self._load(weights)
        except BaseException:
            abandon_reload(self.engine.model, self.engine.model_config)
            raise
        finish_reload(self.engine.model, self.engine.model_config)

    async def prepare_weights(self, tensors: dict[str, torch.Tensor], version: int | None
                              ) -> PreparedVLLMSwitch:
        """Phase 1's end, while vLLM serves: load and process the staged ``tensors`` into a
        shadow of the model (:mod:`weightsync_vllm.prepared_switch`), so that the commit
        only copies the processed tensors in, under the pause; a tensor vLLM refuses here
        refuses the stage."""
        shadow = ShadowModel(self.engine.model)
        try:
            start_reload(shadow.root)
            await self._load(_each(tensors), shadow.root)
            shadow.check_loaded()
            finish_reload(shadow.root, self.engine.model_config)
            return shadow.switch()
        finally:
            shadow.forget_reload_state()

    async def _load(self, weights: AsyncIterator[tuple[str, torch.Tensor]],
                    model: torch.nn.Module | None = None) -> None:
        """Load ``weights`` into ``model`` (the engine's current target model by default)."""
        model = self.engine.model if model is None else model
        if not isinstance(model, _LoadsWeights):
            raise TypeError(
                f"the weight-update target {type(model).__name__} has no load_weights(); "
                "weightsync loads received tensors through it"
            )
        expected = self.engine.expected_weights()
        needed = self._needed_boxes(expected)
        shapes = expected.shapes() if expected is not None else {}
        received: set[str] = set()
        self.load_seconds = 0.0
        async for name, tensor in weights:
            if expected is not None:
                if needed is not None and name in needed.boxes:
                    tensor = whole_tensor(name, tensor, needed.boxes[name], shapes[name])
                expected.check(name, tensor)
            start = time.perf_counter()
            try:
                model.load_weights([(name, tensor)])
            except Exception as error:
                raise WeightSyncError(
                    f"vLLM's {type(model).__name__}.load_weights refused tensor {name!r} "
                    f"(shape {list(tensor.shape)}, {tensor.dtype}): {error!r}"
                ) from error
            self.load_seconds += time.perf_counter() - start
            received.add(name)
        if expected is not None:
            expected.check_complete(received)


class WeightsyncTransferEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    """A vLLM weight-transfer engine that receives over any installed weightsync backend.

    Its init info is :class:`WeightsyncInitInfo`, a
    :class:`~weightsync_core.CheckpointEngineConfig` (as a dict: ``backend``,
    ``update_weights_bucket_megabytes``, ``engine_kwargs``, ``sync_timeout_seconds``,
    ``verify``, ...). Its update info is :class:`WeightsyncUpdateInfo`. The weightsync
    engine's own stages (``prepare``, ``init_process_group``, ``finalize``, ...) are run by
    :meth:`call`, which :class:`~weightsync_vllm.extension.WeightsyncWorkerExtension` exposes
    to ``collective_rpc``.
    """

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loop = EventLoopThread()
        self._worker: CheckpointEngineWorker | None = None
        self._expected: ExpectedWeights | None = expected_weights_of(
            self.model_config, str(self.vllm_config.load_config.load_format)
        )
        self._loader = _ModelLoader(self)
        self.adapters = LoRAStore(self._default_model,
                                  lambda: self.worker.config.adapter_versions)
        """The LoRA adapter versions this vLLM worker holds."""
        self._stage: concurrent.futures.Future[dict[str, float]] | None = None
        self.last_stats: dict[str, float] = {}
        """What the last update moved (``num_tensors``, ``nbytes``, ``seconds``, ...) and the
        seconds vLLM spent on it: ``load_seconds`` in ``load_weights``, ``finish_seconds`` in
        the reload's processing at its end."""

    def expected_weights(self) -> ExpectedWeights | None:
        """What a sync into the current target model must deliver, by checkpoint name
        (``None`` when unknown: a model vLLM did not load from a local checkpoint, or a
        draft model)."""
        return self._expected if self.model is self._default_model else None

    def layout_spec(self) -> LayoutSpec | None:
        """What this vLLM worker needs of the checkpoint: its tensor-parallel slices of a
        Qwen2/Llama model or of a Qwen2-MoE/Qwen3-MoE one (its experts' slices or, with
        ``enable_expert_parallel``, its whole experts), None (every tensor whole)
        otherwise."""
        from vllm.distributed import get_tensor_model_parallel_rank

        size = self.parallel_config.tensor_parallel_size
        rank = get_tensor_model_parallel_rank() if size > 1 else 0
        return tensor_parallel_layout_spec(self.model_config.hf_config, size, rank,
                                           self.parallel_config.enable_expert_parallel)

    @property
    def worker(self) -> CheckpointEngineWorker:
        """The weightsync worker of this vLLM worker (after ``init_weight_transfer_engine``)."""
        if self._worker is None:
            raise WeightSyncError(
                "the weightsync weight-transfer engine is not initialised; call "
                "init_weight_transfer_engine(WeightTransferInitRequest(init_info="
                "{'backend': ...})) first"
            )
        return self._worker

    def _timeout(self) -> float:
        return self.worker.config.sync_timeout_seconds + _STAGE_MARGIN_SECONDS

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        """Build the configured weightsync backend in this process (a second call replaces
        the first engine, closing it)."""
        self._close_engine()

        async def build() -> CheckpointEngineWorker:
            return CheckpointEngineWorker(init_info, server_adapter=self._loader)

        self._worker = self._loop.run(build())
        logger.info("weightsync weight-transfer engine: backend %r", init_info.backend)

    def call(self, method: str, kwargs: dict[str, Any]) -> Any:
        """Run one weightsync engine method (``prepare``, ``init_process_group``,
        ``finalize``, ``address``, ...), bounded by the sync timeout."""
        function = getattr(self.worker.checkpoint_engine, method, None)
        if function is not None:
            kwargs = typed_arguments(function, kwargs)
        return self._loop.run(
            self.worker.execute_checkpoint_engine(method, **kwargs), self._timeout()
        )

    def start_weight_update(self) -> None:
        """Prepare the model to take checkpoint-format weights (vLLM's layerwise reload)."""
        start_reload(self.model)

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        """Receive one version of the weights over the weightsync backend into the model.

        Whatever fails (the sender, the wire, a tensor the model refuses, one that never
        came, the timeout), the reload is abandoned before the error is raised: the layers
        that had all their weights keep them, the others keep their old ones, nothing is
        left half-loaded, and the next update starts cleanly. A sync from weightsync's
        manager loads as it receives: after a failure the model holds a mix of versions
        (weightsync's rollout worker refuses to serve until a sync succeeds). A sync the
        trainer drives through vLLM's trainer API is staged (:meth:`_sync_with_trainer`):
        a failure before the whole version arrived and was checked leaves every layer on
        the version it served."""
        if update_info.trainer_inbox is None:
            receive = self.worker.update_weights(
                update_info.global_steps, update_info.allow_manifest_change,
                update_info.delta_base, update_info.delta_version)
        else:
            receive = self._sync_with_trainer(update_info)
        try:
            stats = self._loop.run(receive, self._timeout())
        except BaseException:
            abandon_reload(self.model, self.model_config)
            raise
        self.last_stats = {**stats, "load_seconds": self._loader.load_seconds}

    async def _sync_with_trainer(self, update: WeightsyncUpdateInfo) -> dict[str, float]:
        """This worker's side of a sync the trainer drives: take the sync's key, send the
        trainer this engine's metadata, join the group with the arguments it answers,
        receive the version whole and checked into a stage (vLLM's model untouched),
        finalize (abort on any failure), then load the stage into the model
        (:meth:`CheckpointEngineWorker.commit_staged`: where vLLM refuses a tensor part-way,
        the version it served is loaded back from the worker's copy of it).

        The worker keeps the stage as that copy once loaded: one more host copy of the
        weights this worker serves, and during a sync a second one (the stage)."""
        if update.session_key is None or update.trainer_inbox is None:
            raise WeightSyncError(
                "a trainer-driven update needs both trainer_inbox and session_key"
            )
        key = bytes.fromhex(update.session_key)
        worker = self.worker
        timeout = worker.config.sync_timeout_seconds
        channel: ControlChannel[RendezvousMessage] = ControlChannel(default_host(),
                                                                    RendezvousMessage)
        channel.use_key(key)
        try:
            await worker.execute_checkpoint_engine("set_session_key", key=key)
            metadata = await worker.execute_checkpoint_engine("prepare")
            await channel.send(update.trainer_inbox,
                               Joined(_receiver_rank(self.parallel_config), channel.endpoint,
                                      metadata), timeout)
            answer = await channel.receive(timeout)
            if not isinstance(answer, Arguments):
                raise WeightSyncError(f"the trainer answered {type(answer).__name__}, not "
                                      "this worker's group arguments")
            join = worker.checkpoint_engine.init_process_group
            await worker.execute_checkpoint_engine(
                "init_process_group", **typed_arguments(join, answer.kwargs))
            # vLLM's reload of the model has started (start_weight_update): nothing to
            # prepare beside it; the commit loads the stage into it
            staged = await worker.stage_weights(update.global_steps,
                                                update.allow_manifest_change,
                                                update.delta_base, update.delta_version,
                                                prepare=False)
            await worker.execute_checkpoint_engine("finalize")
        except BaseException:
            with contextlib.suppress(Exception):  # the sync's own error is the one to raise
                await worker.execute_checkpoint_engine("abort")
            raise
        finally:
            channel.close()
        return {**staged, **await worker.commit_staged()}

    # -- LoRA adapters: added beside the versions served, the model untouched, vLLM serving
    def update_adapter(self, global_steps: int, adapter: dict[str, Any], lora_id: int,
                       delta_base: str | None = None, delta_version: str | None = None,
                       ) -> dict[str, float]:
        """Receive version ``global_steps`` of the LoRA adapter ``adapter`` (its
        :class:`~weightsync_core.data.adapters.AdapterSpec` as plain data) over the
        weightsync backend and add it to vLLM as LoRA ``lora_id``
        (:meth:`CheckpointEngineWorker.update_weights` with ``adapter``); the versions
        served and the model are left as they are, whatever fails."""
        self.adapters.next_lora_id = lora_id
        try:
            return self._loop.run(self.worker.update_weights(
                global_steps, False, delta_base, delta_version, adapter=adapter),
                self._timeout())
        finally:
            self.adapters.next_lora_id = None

    def adapter_status(self) -> dict[str, Any]:
        """The adapter versions this worker holds, by LoRA id (:meth:`LoRAStore.status`)."""
        return self._on_loop(self.adapters.status)

    def release_adapters(self, lora_ids: list[int]) -> list[int]:
        """Let vLLM go of those retired ``lora_ids`` (no request in flight uses them);
        returns the ids still retired."""
        return self._on_loop(lambda: self.adapters.release(lora_ids))

    def restore_adapters(self) -> None:
        """Add back the adapters vLLM dropped when it reloaded the base weights."""
        self._on_loop(self.adapters.restore)

    def _on_loop(self, call: Callable[[], T]) -> T:
        """``call()`` on this engine's loop (where adapter syncs change the store)."""
        async def run() -> T:
            return call()

        return self._loop.run(run(), _STAGE_MARGIN_SECONDS)

    # -- staged updates: phase 1 in the background while vLLM serves, phase 2 under a pause
    def begin_stage(self, update_info: dict[str, Any]) -> None:
        """Start receiving one version into the stage of this worker's weightsync worker
        (:meth:`CheckpointEngineWorker.stage_weights`), in the background on this engine's
        loop, and return: vLLM serves its weights meanwhile (nothing is loaded). Poll
        :meth:`stage_status`."""
        update = WeightsyncUpdateInfo(**update_info)
        self._stage = asyncio.run_coroutine_threadsafe(self.worker.stage_weights(
            update.global_steps, update.allow_manifest_change, update.delta_base,
            update.delta_version), self._loop.loop)

    def stage_status(self) -> dict[str, Any]:
        """``{"done": False}`` while the stage is being received; then, as often as asked
        (the workers of a tensor-parallel engine are asked together until all are done),
        ``{"done": True}`` and its figures, or the error it failed with (raised)."""
        stage = self._stage
        if stage is None:
            raise WeightSyncError("no stage is being received: begin_stage first")
        if not stage.done():
            return {"done": False}
        return {"done": True, **stage.result()}

    def commit_staged(self) -> dict[str, float]:
        """Load the stage into the model in one layerwise reload (the caller has paused
        vLLM); where vLLM refuses it, the reload is abandoned and the version served is
        reloaded from the worker's copy (:meth:`CheckpointEngineWorker.commit_staged`)."""
        return self._reloading(self.worker.commit_staged())

    def roll_back_commit(self) -> None:
        """Reload the version the last commit replaced (another worker of the replica failed
        to take its stage)."""
        self._reloading(self.worker.roll_back_commit())

    def roll_back_if_taken(self, version: int | None) -> None:
        """Where this worker took staged ``version`` (another worker of its engine failed
        to: the engine serves one version), reload the version it replaced."""
        if self.worker.weights_version == version and self.worker.replaced_copy is not None:
            self.roll_back_commit()

    def discard_staged(self) -> None:
        """Drop the stage (vLLM never saw it)."""
        self._stage = None

        async def discard() -> None:
            self.worker.discard_staged()

        self._loop.run(discard(), _STAGE_MARGIN_SECONDS)

    def forget_replaced(self) -> None:
        """Drop the copy of the version the last commit replaced."""
        async def forget() -> None:
            self.worker.forget_replaced()

        self._loop.run(forget(), _STAGE_MARGIN_SECONDS)

    def weights_status(self) -> dict[str, Any]:
        """The weightsync worker's :meth:`CheckpointEngineWorker.weights_status`."""
        async def status() -> dict[str, Any]:
            return self.worker.weights_status()

        return self._loop.run(status(), _STAGE_MARGIN_SECONDS)

    def _reloading(self, update: Coroutine[Any, Any, T]) -> T:
        self._loader.reloads = True
        try:
            return self._loop.run(update, self._timeout())
        finally:
            self._loader.reloads = False

    def finish_weight_update(self) -> None:
        """Process the loaded weights into the model's kernels (vLLM's layerwise reload),
        tied layers included."""
        start = time.perf_counter()
        finish_reload(self.model, self.model_config)
        self.last_stats["finish_seconds"] = time.perf_counter() - start

    def _close_engine(self) -> None:
        if self._worker is not None:
            worker, self._worker = self._worker, None
            self._loop.run(worker.execute_checkpoint_engine("close"), _STAGE_MARGIN_SECONDS)

    def shutdown(self) -> None:
        """Close the weightsync engine and its listeners; the vLLM worker keeps serving."""
        try:
            self._close_engine()
        finally:
            self._loop.close()
            self._loop = EventLoopThread()
