"""A staged sync into a server that prepares its switch (its adapter's ``prepare_weights``):
phase 1 ends with the server's own form of the new version built beside the one it serves;
the commit only applies it (no load under the pause), all or nothing; a roll-back undoes it;
a stage dropped for any reason releases what was prepared."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

from weightsync_core import (
    CheckpointEngineConfig,
    CheckpointEngineWorker,
    PreparedSwitch,
    WeightSyncError,
)

NAMES = ("embed", "layer.weight", "head")


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"embed": (64, 32), "layer.weight": (32, 32), "head": (32, 64)}
    return {name: torch.randn(shapes[name], generator=generator) for name in NAMES}


def _kernel_form(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the server computes with: each weight transposed and contiguous (a conversion on
    load, as vLLM's kernels repack theirs)."""
    return {name: tensor.t().contiguous() for name, tensor in weights.items()}


class _Switch:
    """The server's prepared switch: its kernel form of one version, swapped in by
    :meth:`apply` (refused where the server says so), swapped back by :meth:`undo`."""

    def __init__(self, server: _ConvertingServer, kernels: dict[str, torch.Tensor]) -> None:
        self.server = server
        self.kernels: dict[str, torch.Tensor] | None = kernels
        self.nbytes = sum(tensor.numel() * tensor.element_size() for tensor in kernels.values())
        self.released = False

    def apply(self) -> None:
        self.server.lifecycle.append("apply")
        if self.server.refuse_apply:
            raise RuntimeError("the kernels refused the new weights")
        assert self.kernels is not None
        self.server.kernels, self.kernels = self.kernels, self.server.kernels

    def undo(self) -> None:
        self.server.lifecycle.append("undo")
        assert self.kernels is not None
        self.server.kernels, self.kernels = self.kernels, self.server.kernels

    def release(self) -> None:
        self.kernels, self.released = None, True


class _ConvertingServer:
    """A server whose kernels hold its own form of the weights; it loads a sync as it
    arrives (``update_weights``) or prepares a staged one (``prepare_weights``)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.kernels = _kernel_form(weights)
        self.lifecycle: list[str] = []
        self.switches: list[_Switch] = []
        self.refuse_prepare = False
        self.refuse_apply = False

    async def pause_generation(self, mode: str = "keep") -> None:
        self.lifecycle.append("pause")

    async def resume_generation(self) -> None:
        self.lifecycle.append("resume")

    async def update_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]],
                             global_steps: int | None = None) -> None:
        self.lifecycle.append("load")
        self.kernels = _kernel_form({name: tensor async for name, tensor in weights})

    def prepare_weights(self, tensors: dict[str, torch.Tensor], version: int | None
                        ) -> PreparedSwitch:
        self.lifecycle.append("prepare")
        if self.refuse_prepare:
            raise ValueError("no room for a second copy of the kernels")
        switch = _Switch(self, _kernel_form(tensors))
        self.switches.append(switch)
        return switch

    def serves(self, weights: dict[str, torch.Tensor]) -> bool:
        expected = _kernel_form(weights)
        return all(torch.equal(self.kernels[name], expected[name]) for name in NAMES)


class _Sync:
    """A worker on the naive engine and its converting server."""

    def __init__(self, initial: dict[str, torch.Tensor]) -> None:
        self.server = _ConvertingServer(initial)
        self.worker = CheckpointEngineWorker(CheckpointEngineConfig(backend="naive"),
                                             server_adapter=self.server)

    def stage(self, weights: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        asyncio.run(self.worker.checkpoint_engine.send_weights(iter(weights.items())))
        return asyncio.run(self.worker.stage_weights(step))

    def switch(self) -> dict[str, float]:
        return asyncio.run(self.worker.switch_to_staged("keep", timeout_seconds=5))


def _bytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in weights.values())


def test_the_switch_is_prepared_in_phase_one_and_only_applied_under_the_pause():
    initial, new = _weights(0), _weights(1)
    sync = _Sync(initial)
    stats = sync.stage(new, 1)
    assert sync.server.lifecycle == ["prepare"] and sync.server.serves(initial)
    assert stats["prepared_bytes"] == _bytes(new) and stats["prepare_seconds"] >= 0
    assert sync.worker.weights_status()["staged_bytes"] == 2 * _bytes(new)  # stage + kernels
    sync.switch()
    assert sync.server.lifecycle == ["prepare", "pause", "apply", "resume"]  # no load
    assert sync.server.serves(new)
    status = sync.worker.weights_status()
    assert (status["version"], status["complete"], status["staged_version"]) == (1, True, None)
    assert status["staged_bytes"] == 0 and status["rollback_bytes"] == 0
    assert sync.server.switches[0].released  # what undoing it needed: dropped at the end
    sync.stage(_weights(2), 2)
    sync.switch()
    assert sync.server.serves(_weights(2))


def test_a_server_that_cannot_prepare_refuses_the_stage_in_phase_one():
    initial = _weights(0)
    sync = _Sync(initial)
    sync.server.refuse_prepare = True
    with pytest.raises(WeightSyncError, match=r"could not prepare its switch to staged "
                       r"version 1: ValueError\('no room"):
        sync.stage(_weights(1), 1)
    assert sync.server.serves(initial) and sync.worker.staged is None
    assert sync.worker.weights_status()["complete"]
    sync.server.refuse_prepare = False
    sync.stage(_weights(2), 2)  # the next sync proceeds normally
    sync.switch()
    assert sync.server.serves(_weights(2))


def test_a_switch_the_server_refuses_leaves_it_serving_its_version():
    sync = _Sync(_weights(0))
    sync.stage(_weights(1), 1)
    sync.switch()
    sync.stage(_weights(2), 2)
    sync.server.refuse_apply = True
    with pytest.raises(WeightSyncError, match=r"failed to switch to staged version 2: .* it "
                       r"kept version 1, which it serves"):
        sync.switch()
    assert sync.server.serves(_weights(1)) and sync.server.lifecycle[-1] == "resume"
    assert sync.server.switches[-1].released
    status = sync.worker.weights_status()
    assert (status["version"], status["complete"], status["staged_version"]) == (1, True, None)
    sync.server.refuse_apply = False
    sync.stage(_weights(3), 3)
    sync.switch()
    assert sync.server.serves(_weights(3))


def test_rolling_a_commit_back_undoes_the_switch():
    sync = _Sync(_weights(0))
    sync.stage(_weights(1), 1)
    sync.switch()
    sync.stage(_weights(2), 2)
    asyncio.run(sync.worker.commit_staged())  # a replica of several workers: no forget yet
    assert sync.server.serves(_weights(2)) and sync.worker.weights_version == 2
    asyncio.run(sync.worker.roll_back_commit())  # another worker of the replica failed
    assert sync.server.lifecycle[-1] == "undo" and sync.server.serves(_weights(1))
    assert sync.worker.weights_version == 1 and sync.server.switches[-1].released
    sync.stage(_weights(3), 3)  # checked against version 1's manifest again
    sync.switch()
    assert sync.server.serves(_weights(3))


def test_a_dropped_stage_releases_what_the_server_prepared():
    sync = _Sync(_weights(0))
    sync.stage(_weights(1), 1)
    sync.stage(_weights(2), 2)  # replaces the stage not committed
    assert sync.server.switches[0].released and not sync.server.switches[1].released
    sync.worker.discard_staged()
    assert sync.server.switches[1].released
    sync.stage(_weights(3), 3)
    asyncio.run(sync.worker.checkpoint_engine.send_weights(iter(_weights(4).items())))
    asyncio.run(sync.worker.update_weights(4))  # a sync loaded as it arrives
    assert sync.server.switches[2].released and sync.server.serves(_weights(4))


def test_a_stage_not_prepared_is_loaded_at_its_commit():
    """``prepare=False`` (a server already in an update it did not start, as vLLM's
    trainer-driven one): nothing is prepared; the commit loads the stage."""
    sync = _Sync(_weights(0))
    asyncio.run(sync.worker.checkpoint_engine.send_weights(iter(_weights(1).items())))
    stats = asyncio.run(sync.worker.stage_weights(1, prepare=False))
    assert "prepared_bytes" not in stats and sync.server.lifecycle == []
    assert sync.server.serves(_weights(0))
    asyncio.run(sync.worker.commit_staged())
    assert sync.server.lifecycle == ["load"] and sync.server.serves(_weights(1))
    assert sync.worker.weights_status()["rollback_version"] == 1  # the copy to roll back to
