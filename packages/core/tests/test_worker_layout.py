"""A rollout worker whose server needs only part of the weights: refused under an engine that
delivers whole tensors, unless its server can also take them whole."""

import asyncio

import pytest

from weightsync_core import CheckpointEngineConfig, CheckpointEngineWorker, WeightSyncError
from weightsync_core.data.shards import fsdp_spec


class _PartialServer:
    """Needs its half of every tensor's rows."""

    takes_whole_weights = False

    def weight_layout(self):
        return fsdp_spec(2, 0)

    async def update_weights(self, weights, global_steps=None):
        async for _ in weights:
            pass


class _ShardKeepingServer(_PartialServer):
    """Needs its half, but keeps it out of a whole tensor as well (as vLLM's loaders do)."""

    takes_whole_weights = True


def _prepare(server: _PartialServer, backend: str):
    worker = CheckpointEngineWorker(CheckpointEngineConfig(backend=backend),
                                    server_adapter=server)

    async def prepare():
        try:
            return await worker.execute_checkpoint_engine("prepare")
        finally:
            await worker.execute_checkpoint_engine("close")

    return asyncio.run(prepare())


def test_a_server_needing_a_part_is_refused_under_a_whole_tensor_backend():
    with pytest.raises(WeightSyncError, match=r"needs only part.*use backend 'gloo_sharded'"):
        _prepare(_PartialServer(), "gloo")


def test_a_server_that_keeps_its_part_of_whole_tensors_receives_them_whole():
    assert _prepare(_ShardKeepingServer(), "gloo")


def test_a_sharded_backend_hands_the_servers_layout_to_the_driver():
    assert _prepare(_ShardKeepingServer(), "gloo_sharded")["layout"] == fsdp_spec(2, 0)
