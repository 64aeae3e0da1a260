"""The previous sync's manifest is the reference for the next only when the server took the
whole stream: a sync the server refused at its end never becomes the reference."""

import asyncio

import pytest
import torch

from weightsync_core.api.engine import SyncProgress
from weightsync_core.api.errors import ManifestChangedError, WeightSyncError
from weightsync_core.data.verification import ManifestGuard
from weightsync_core.worker.delivery import deliver_weights as _deliver


async def _stream(names):
    for name in names:
        yield name, torch.zeros(2)


class _Server:
    """Loads every tensor; refuses the stream at its end when ``required`` is missing."""

    def __init__(self, required: set[str]) -> None:
        self.required = required

    async def update_weights(self, weights, global_steps=None):
        names = {name async for name, _ in weights}
        if missing := self.required - names:
            raise WeightSyncError(f"the model's {sorted(missing)} were not sent")


def _sync(guard: ManifestGuard, names, allow_change: bool = False) -> None:
    guard.start(allow_change=allow_change)
    asyncio.run(_deliver(_Server({"a", "b"}), _stream(names), 1, guard, SyncProgress()))


def test_a_refused_first_sync_is_not_the_reference_of_the_next():
    guard = ManifestGuard()
    with pytest.raises(WeightSyncError, match=r"\['b'\] were not sent"):
        _sync(guard, ["a"])
    _sync(guard, ["a", "b"])  # the first accepted stream: the reference from now on
    with pytest.raises(ManifestChangedError, match="missing from this one: b"):
        _sync(guard, ["a"])
