"""weightsync on vLLM's trainer side: ``WeightTransferTrainerFactory.trainer_init(
WeightsyncTrainerInitInfo(...), client=..., source=...)`` sends over any installed weightsync
backend, with no weightsync manager and no Ray in the trainer process.

Importing this module registers the engine ``weightsync`` with vLLM's trainer factory. Each
``send_weights()`` is one sync. The trainer opens a rendezvous inbox
(:mod:`weightsync_vllm.rendezvous`) on its configured host. It hands vLLM's workers the inbox
and a fresh session key through vLLM's own ``update_weights`` call (HTTP or Ray, whichever
``client`` is). Each worker sends back its engine's metadata, sealed with that key. The
trainer builds the topology and answers each worker with its group arguments. Then the
weights move as in any weightsync sync, verified, and the trainer calls
``finish_weight_update``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from weightsync_core import (
    CheckpointEngineConfig,
    WeightSyncError,
    build_engine,
    new_session_key,
)
from weightsync_core.spi import ControlChannel, default_host, run_blocking
from weightsync_vllm.event_loop import EventLoopThread
from weightsync_vllm.plugin import BACKEND_NAME
from weightsync_vllm.rendezvous import Arguments, RendezvousMessage, gather_joins

__all__ = ["WeightsyncTrainerEngine", "WeightsyncTrainerInitInfo"]

logger = logging.getLogger(__name__)

_CALL_MARGIN_SECONDS = 10.0
"""How much longer than the sync timeout the trainer waits for vLLM's ``update_weights``
call to return, so that the workers' own timeout (which names what they waited for) fires
first."""


@dataclasses.dataclass
class WeightsyncTrainerInitInfo(TrainerInitInfo):
    """The trainer side of weightsync on vLLM.

    Attributes:
        config: how the weights move (backend, buckets, timeout, verification, engine
            options); vLLM's workers get the same.
        num_receivers: vLLM workers that receive (each a full copy): all the workers of the
            replicas this client reaches, e.g. ``tensor_parallel_size`` times the
            data-parallel size.
        host: the address the trainer's inbox and engine bind to, which the workers reach
            (default: ``WEIGHTSYNC_HOST``, else 127.0.0.1).
    """

    backend: ClassVar[str] = BACKEND_NAME
    config: CheckpointEngineConfig = dataclasses.field(
        default_factory=lambda: CheckpointEngineConfig(backend="gloo"))
    num_receivers: int = 1
    host: str | None = None


class WeightsyncTrainerEngine(TrainerWeightTransferEngine[WeightsyncTrainerInitInfo]):
    """Sends ``source``'s weights into vLLM's workers over a weightsync backend, one sync per
    :meth:`send_weights`. Trainer rank 0 sends. The other ranks only iterate ``source``, so
    that the trainer's own collectives (FSDP's ``full_tensor()``) stay aligned.

    A failed sync raises on the trainer, naming the cause, within the configured timeout.
    vLLM's workers end their reload cleanly and report the update failed. vLLM keeps running
    on the mix of versions the failure left, so call ``send_weights`` again before serving.
    """

    init_info_cls = WeightsyncTrainerInitInfo

    def __init__(self, init_info: WeightsyncTrainerInitInfo, *, client: Any,
                 source: WeightSource | None) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.config = init_info.config
        self.num_receivers = init_info.num_receivers
        self.host = init_info.host or default_host()
        self._steps = itertools.count(1)
        self._loop = EventLoopThread("weightsync-vllm-trainer")
        self._engine = build_engine(self.config) if self.is_sender else None

    @classmethod
    def trainer_init(cls, init_info: WeightsyncTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> Self:
        """Build the trainer's engine and, on rank 0, vLLM's workers' engines.

        Raises:
            ValueError: no ``source``, or fewer than one receiver.
        """
        if source is None:
            raise ValueError("weightsync's trainer engine sends a WeightSource each round; "
                             "pass source=")
        if init_info.num_receivers < 1:
            raise ValueError(f"num_receivers must be at least 1, got {init_info.num_receivers}")
        engine = cls(init_info, client=client, source=source)
        if engine.is_sender:
            client.init_weight_transfer_engine(dataclasses.asdict(init_info.config))
        return engine

    def send_weights(self, global_steps: int | None = None) -> None:
        """One sync of ``source``'s current weights (version ``global_steps``, default: one
        more than the last).

        Raises:
            WeightSyncError: the sync failed (its cause first); vLLM was told nothing
                completed.
        """
        if self.source is None:
            raise ValueError("this engine has no WeightSource")
        if not self.is_sender:
            for _ in self.source:  # the trainer's collectives (FSDP gathers) stay aligned
                pass
            return
        step = next(self._steps) if global_steps is None else global_steps
        key = new_session_key()
        channel: ControlChannel[RendezvousMessage] = ControlChannel(self.host,
                                                                    RendezvousMessage)
        channel.use_key(key)
        call_timeout = self.config.sync_timeout_seconds + _CALL_MARGIN_SECONDS
        self.client.start_weight_update()
        calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-vllm-call")
        receiving = calls.submit(self.client.update_weights, {
            "global_steps": step, "trainer_inbox": channel.endpoint, "session_key": key.hex(),
        })
        try:
            self._loop.run(self._send(channel, key, step, receiving),
                           self.config.sync_timeout_seconds)
            receiving.result(timeout=call_timeout)
        except BaseException:
            if self._engine is not None:
                with contextlib.suppress(Exception):  # the sync's own error is the one to raise
                    self._engine.abort()
            # let vLLM's workers end their side (bounded by their timeout), so that the next
            # sync does not find their update still running
            with contextlib.suppress(Exception):
                receiving.result(timeout=call_timeout)
            raise
        finally:
            calls.shutdown(wait=False)  # a hung HTTP call must not hang the trainer too
            channel.close()
        self.client.finish_weight_update(str(step))

    async def _send(self, channel: ControlChannel[RendezvousMessage], key: bytes, step: int,
                    receiving: Future[None]) -> None:
        engine = self._engine
        if engine is None or self.source is None:
            raise RuntimeError("only trainer rank 0 sends")
        timeout = self.config.sync_timeout_seconds
        engine.set_session_key(key)
        own = engine.prepare()  # the workers' arrive as MessagePack made them, as in vLLM
        try:
            joins = await gather_joins(channel, self.num_receivers, timeout)
        except WeightSyncError:
            if receiving.done() and receiving.exception() is not None:
                raise WeightSyncError(f"vLLM's update_weights failed before its workers "
                                      f"joined: {receiving.exception()!r}") from None
            raise
        actor_kwargs, rollout_kwargs = type(engine).build_topology(
            1, self.num_receivers, [own, *(join.metadata for join in joins)])
        for rank, join in enumerate(joins):
            await channel.send(join.reply_to, Arguments(
                {name: values[rank] for name, values in rollout_kwargs.items()}), timeout)
        await run_blocking(engine.init_process_group,
                           **{name: values[0] for name, values in actor_kwargs.items()})
        await engine.send_weights(iter(self.source), step)
        await run_blocking(engine.finalize)

    def shutdown(self) -> None:
        """Close the trainer's engine and vLLM's workers' engines."""
        try:
            if self._engine is not None:
                self._engine.close()
                # vLLM's HTTP and Ray clients have it; its client protocol does not
                release = getattr(self.client, "shutdown_weight_transfer_engine", None)
                if release is not None:
                    release()
        finally:
            self._loop.close()


with contextlib.suppress(ValueError):  # imported a second time under another name
    WeightTransferTrainerFactory.register_engine(BACKEND_NAME, WeightsyncTrainerEngine)
