"""Syncs quantized on send (``rollout_quantization="fp8_block"``) over ``mooncake``: ten delta syncs
in a row (none, all, one element, 2% changed), every worker bit-exact on the float8 bytes and
scales each time; and through ``mooncake_sharded``, FSDP rows of 2 actor ranks (blocks spanning
both) into a whole and a TP=2 replica, every worker bit-exact on its slices and scales."""

import pytest

from weightsync_core.testing import SyncHarness
from weightsync_core.testing.quantized_syncs import (
    check_quantized_delta_syncs,
    check_sharded_quantized_delta_syncs,
    quantized_config,
)


@pytest.fixture(scope="module")
def harness():
    config = quantized_config("mooncake", engine_kwargs={"mooncake": {"protocol": "tcp"}})
    harness = SyncHarness(config, actor_world_size=1, replica_sizes=(1, 1))
    yield harness
    harness.shutdown()


def test_ten_delta_syncs_of_fp8_are_the_quantized_bytes_on_every_worker(harness):
    check_quantized_delta_syncs(harness)


@pytest.fixture(scope="module")
def sharded_harness():
    config = quantized_config("mooncake_sharded",
                              engine_kwargs={"mooncake_sharded": {"protocol": "tcp"}})
    harness = SyncHarness(config, actor_world_size=2, replica_sizes=(1, 2))
    yield harness
    harness.shutdown()


def test_ten_sharded_delta_syncs_of_fp8_are_every_workers_slices(sharded_harness):
    check_sharded_quantized_delta_syncs(sharded_harness)
