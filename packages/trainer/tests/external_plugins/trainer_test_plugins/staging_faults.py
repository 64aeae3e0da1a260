"""A rollout worker and a policy source that fail on demand, for the staged syncs' failure
matrix (test_staged_hf_failures.py): each fault acts once, in phase 1 (as a tensor is staged)
or in phase 2 (the switch), or on the sending side."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator
from typing import Any

import torch

from weightsync_core.testing.actors import corrupt_bucket_checksum
from weightsync_trainer.bench_stall import PolicySource
from weightsync_trainer.workers.rollout import RolloutWorker

STAGE_FAULTS = ("refuse_stage", "die_in_stage", "stall_stage")
SWITCH_FAULTS = ("refuse_switch", "die_in_switch", "stall_in_pause")


class FaultyRolloutWorker(RolloutWorker):
    """A rollout worker (HF replica of one process) whose server fails once, as set by
    :meth:`set_fault`."""

    def set_fault(self, fault: str, after: int = 0) -> None:
        """Phase 1, from the ``after``-th staged tensor on: ``refuse_stage`` (the server
        refuses it), ``die_in_stage`` (the process exits), ``stall_stage`` (it never
        answers). Phase 2, in the next switch: ``refuse_switch`` (the server refuses the
        stage), ``die_in_switch`` (the process exits), ``stall_in_pause`` (the server pauses
        and never gets further)."""
        server: Any = self._server()
        if fault in STAGE_FAULTS:
            own, count = server.check_staged_weight, itertools.count()

            async def check(name: str, tensor: torch.Tensor) -> None:
                if next(count) >= after:
                    del server.check_staged_weight
                    await _act(fault, f"the server refused staged tensor {name!r}")
                own(name, tensor)

            server.check_staged_weight = check
        elif fault in ("refuse_switch", "die_in_switch"):
            def swap(tensors: dict[str, torch.Tensor], version: int | None) -> Any:
                del server.swap_weights
                if fault == "die_in_switch":
                    os._exit(1)
                raise ValueError(f"the server refused to switch to version {version}")

            server.swap_weights = swap
        elif fault == "stall_in_pause":
            own_pause = server.pause_generation

            async def pause(mode: str = "keep") -> None:
                del server.pause_generation
                await own_pause(mode)
                await asyncio.sleep(3600)

            server.pause_generation = pause
        else:
            raise ValueError(f"unknown fault {fault!r}: one of {STAGE_FAULTS + SWITCH_FAULTS}")


async def _act(fault: str, refusal: str) -> None:
    if fault == "die_in_stage":
        os._exit(1)
    if fault == "stall_stage":
        await asyncio.sleep(3600)
    raise ValueError(refusal)


class FaultyPolicySource(PolicySource):
    """The actor side, able to exit mid-stream or to corrupt a bucket's checksum."""

    die_after: int | None = None

    def die_after_tensors(self, count: int) -> None:
        """Exit once ``count`` tensors of the next sync were read."""
        self.die_after = count

    def corrupt_bucket(self, bucket: int | None) -> None:
        """Announce a wrong checksum for the ``bucket``-th bucket packed from now on (None:
        the engine's own again)."""
        corrupt_bucket_checksum(self.checkpoint_engine, bucket)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, by name, unless set to exit before."""
        for index, item in enumerate(super().iter_weights()):
            if self.die_after is not None and index >= self.die_after:
                os._exit(1)
            yield item
