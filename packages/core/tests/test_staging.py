"""A rollout worker's staged sync, in one process through the ``naive`` engine: phase 1
stages and checks a version while the server keeps serving its own, untouched; phase 2 hands
it over, and rolls the server back to the version it served where that fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

from weightsync_core import CheckpointEngineConfig, CheckpointEngineWorker, WeightSyncError
from weightsync_core.api.errors import ManifestChangedError
from weightsync_core.data.delta import DeltaPlan, DeltaSender

NAMES = ("embed", "layer.weight", "layer.bias", "head")


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"embed": (64, 32), "layer.weight": (32, 32), "layer.bias": (32,),
              "head": (32, 64)}
    return {name: torch.randn(shapes[name], generator=generator) for name in NAMES}


class _Server:
    """An inference server that loads what it gets into parameters of its own (as HF's and
    vLLM's do), offers them for in-place delta patching, and may refuse a tensor of one
    version (``refuse``: the version's ``global_steps`` and the tensor's name)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.params = {name: tensor.clone() for name, tensor in weights.items()}
        self.refuse: tuple[int, str] | None = None
        self.loads: list[int | None] = []
        self.stall: str | None = None
        """``"pause"`` or ``"load"``: hang there (a server that never pauses, or, once, a
        load that never finishes)."""
        self.lifecycle: list[str] = []

    async def pause_generation(self, mode: str = "keep") -> None:
        self.lifecycle.append("pause")
        if self.stall == "pause":
            await asyncio.sleep(3600)

    async def resume_generation(self) -> None:
        self.lifecycle.append("resume")

    def patchable_weights(self) -> dict[str, torch.Tensor]:
        return self.params

    async def update_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]],
                             global_steps: int | None = None) -> None:
        async for name, tensor in weights:
            if self.stall == "load" and name == "layer.bias":  # two tensors loaded
                self.stall = None  # once: the roll-back loads
                await asyncio.sleep(3600)
            if self.refuse == (global_steps, name):
                raise ValueError(f"the model has no room for {name!r}")
            if tensor.data_ptr() != self.params[name].data_ptr():
                self.params[name].copy_(tensor)
        self.loads.append(global_steps)

    def holds(self, weights: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(self.params[name], weights[name]) for name in NAMES)


class _Sync:
    """A worker on the naive engine and its server, fed one version at a time."""

    def __init__(self, initial: dict[str, torch.Tensor]) -> None:
        self.server = _Server(initial)
        self.worker = CheckpointEngineWorker(CheckpointEngineConfig(backend="naive"),
                                             server_adapter=self.server)
        self.sender = DeltaSender()

    def _send(self, weights: dict[str, torch.Tensor], plan: DeltaPlan | None) -> None:
        source = (iter(weights.items()) if plan is None else
                  self.sender.encode(iter(weights.items()), plan, None))
        asyncio.run(self.worker.checkpoint_engine.send_weights(source))

    def stage(self, weights: dict[str, torch.Tensor], step: int,
              plan: DeltaPlan | None = None, **options) -> dict[str, float]:
        self._send(weights, plan)
        arguments = {} if plan is None else {"delta_base": plan.base,
                                             "delta_version": plan.version}
        return asyncio.run(self.worker.stage_weights(step, **arguments, **options))

    def commit(self) -> dict[str, float]:
        return asyncio.run(self.worker.commit_staged())

    def load(self, weights: dict[str, torch.Tensor], step: int,
             plan: DeltaPlan | None = None) -> None:
        """A sync loaded as it arrives (the server paused throughout)."""
        self._send(weights, plan)
        arguments = {} if plan is None else {"delta_base": plan.base,
                                             "delta_version": plan.version}
        asyncio.run(self.worker.update_weights(step, **arguments))


def test_a_stage_leaves_the_server_serving_its_version_until_the_commit():
    initial, new = _weights(0), _weights(1)
    sync = _Sync(initial)
    stats = sync.stage(new, 1)
    assert stats["num_tensors"] == len(NAMES)
    assert sync.server.holds(initial) and sync.server.loads == []
    status = sync.worker.weights_status()
    assert status["version"] is None and status["complete"]
    assert status["staged_version"] == 1
    assert status["staged_bytes"] == sum(t.numel() * 4 for t in new.values())
    sync.commit()
    assert sync.server.holds(new) and sync.server.loads == [1]
    status = sync.worker.weights_status()
    assert (status["version"], status["complete"], status["staged_version"]) == (1, True, None)
    assert status["rollback_version"] == 1 and status["staged_bytes"] == 0
    assert status["rollback_bytes"] == sum(t.numel() * 4 for t in new.values())


def test_what_the_server_got_at_a_commit_is_its_own_and_the_copy_stays_private():
    sync = _Sync(_weights(0))
    sync.stage(_weights(1), 1)
    sync.commit()
    for tensor in sync.server.params.values():
        tensor.mul_(3)  # the server converts what it holds
    sync.server.refuse = (2, "head")
    sync.stage(_weights(2), 2)
    with pytest.raises(WeightSyncError, match="rolled back to version 1"):
        sync.commit()
    assert sync.server.holds(_weights(1))  # the copy, not what the server made of it


def test_a_refused_tensor_at_the_commit_rolls_the_server_back_to_its_version():
    sync = _Sync(_weights(0))
    sync.stage(_weights(1), 1)
    sync.commit()
    sync.server.refuse = (2, "layer.bias")  # the third tensor: two were loaded already
    sync.stage(_weights(2), 2)
    with pytest.raises(WeightSyncError, match=r"failed to take staged version 2: the model "
                       r"has no room for 'layer.bias'; it was rolled back to version 1"):
        sync.commit()
    assert sync.server.holds(_weights(1))
    status = sync.worker.weights_status()
    assert (status["version"], status["complete"], status["staged_version"]) == (1, True, None)
    sync.server.refuse = None
    sync.stage(_weights(3), 3)  # the next sync proceeds normally
    sync.commit()
    assert sync.server.holds(_weights(3))


def test_without_a_copy_to_roll_back_to_a_failed_commit_leaves_the_server_refusing():
    sync = _Sync(_weights(0))
    sync.server.refuse = (1, "head")
    sync.stage(_weights(1), 1)
    with pytest.raises(WeightSyncError, match="holds a mix of versions and refuses to serve"):
        sync.commit()
    assert not sync.worker.weights_status()["complete"]


def test_a_failed_stage_stages_nothing_and_leaves_the_server_whole():
    sync = _Sync(_weights(0))
    sync.stage(_weights(1), 1)
    sync.commit()
    changed = {**_weights(2), "head": torch.zeros(16, 64)}
    with pytest.raises(ManifestChangedError, match="'head' changed"):
        sync.stage(changed, 2)
    status = sync.worker.weights_status()
    assert (status["version"], status["complete"], status["staged_version"]) == (1, True, None)
    assert sync.server.holds(_weights(1))
    with pytest.raises(WeightSyncError, match="no staged weights to commit"):
        sync.commit()


def test_a_new_stage_replaces_one_not_committed_and_a_discarded_one_is_gone():
    sync = _Sync(_weights(0))
    sync.stage(_weights(1), 1)
    sync.stage(_weights(2), 2)
    sync.commit()
    assert sync.server.holds(_weights(2)) and sync.server.loads == [2]
    sync.stage(_weights(3), 3)
    sync.worker.discard_staged()
    assert sync.worker.weights_status()["staged_version"] is None
    with pytest.raises(WeightSyncError, match="no staged weights"):
        sync.commit()
    assert sync.server.holds(_weights(2))


def test_a_sync_loaded_as_it_arrives_drops_the_copy_of_an_older_version():
    sync = _Sync(_weights(0))
    sync.stage(_weights(1), 1)
    sync.commit()
    sync.load(_weights(2), 2)
    assert sync.worker.weights_status()["rollback_version"] is None
    sync.server.refuse = (3, "head")
    sync.stage(_weights(3), 3)
    with pytest.raises(WeightSyncError, match="holds a mix"):  # never back to version 1
        sync.commit()


def test_a_staged_delta_patches_a_private_copy_never_the_servers_tensors():
    """A full delta-enabled sync loaded as it arrives makes the server's own tensors the
    receiver's copy (patched in place by later stop-the-world delta syncs); a staged delta
    sync must not write into them while the server serves them."""
    sync = _Sync(_weights(0))
    sync.load(_weights(1), 1, DeltaPlan(version="v1"))
    assert sync.worker.delta_receiver.kept_bytes == 0  # the server's tensors are the copy
    updated = {name: tensor.clone() for name, tensor in _weights(1).items()}
    updated["layer.weight"][3, :5] += 1
    stats = sync.stage(updated, 2, DeltaPlan(version="v2", base="v1"))
    assert stats["delta_changed"] == 5
    assert sync.server.holds(_weights(1))  # untouched while staged
    sync.commit()
    assert sync.server.holds(updated)
    assert sync.worker.weights_status()["delta_version"] == "v2"
    again = {name: tensor.clone() for name, tensor in updated.items()}
    again["head"][0, 0] = 7.0
    sync.stage(again, 3, DeltaPlan(version="v3", base="v2"))
    sync.commit()
    assert sync.server.holds(again)


def test_a_failed_commit_of_a_delta_drops_the_delta_copy_so_the_next_sync_is_full():
    sync = _Sync(_weights(0))
    sync.stage(_weights(1), 1, DeltaPlan(version="v1"))
    sync.commit()
    sync.server.refuse = (2, "head")
    updated = {name: tensor.clone() for name, tensor in _weights(1).items()}
    updated["embed"][0, 0] = 1.5
    sync.stage(updated, 2, DeltaPlan(version="v2", base="v1"))
    with pytest.raises(WeightSyncError, match="rolled back to version 1"):
        sync.commit()
    assert sync.server.holds(_weights(1))
    assert sync.worker.weights_status()["delta_version"] is None


@pytest.mark.parametrize("stall", ["pause", "load"])
def test_a_switch_past_its_deadline_is_given_up_and_the_server_resumes_on_its_version(stall):
    sync = _Sync(_weights(0))
    sync.stage(_weights(1), 1)
    sync.commit()
    sync.stage(_weights(2), 2)
    sync.server.stall = stall
    doing = {"pause": "pausing the server", "load": "committing the stage"}[stall]
    with pytest.raises(WeightSyncError, match=rf"did not finish within 0.3 s .* given up "
                       rf"while {doing}: the stage was not committed, and the server serves "
                       "the version it served"):
        asyncio.run(sync.worker.switch_to_staged("keep", timeout_seconds=0.3))
    assert sync.server.lifecycle == ["pause", "resume"]
    assert sync.server.holds(_weights(1))
    status = sync.worker.weights_status()
    assert (status["version"], status["complete"], status["staged_version"]) == (1, True, None)
    sync.server.stall = None
    sync.stage(_weights(3), 3)  # the next sync proceeds normally
    asyncio.run(sync.worker.switch_to_staged("keep", timeout_seconds=5))
    assert sync.server.holds(_weights(3))
