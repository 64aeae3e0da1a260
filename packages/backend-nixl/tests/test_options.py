"""Registration and option validation (a real NIXL agent where one is needed)."""

import pytest
import torch

from weightsync_core import CheckpointEngineRegistry, WeightSyncError
from weightsync_nixl import NixlCheckpointEngine, NixlTransport


def test_registered_through_the_entry_point():
    assert CheckpointEngineRegistry.get("nixl") is NixlCheckpointEngine


def test_ucx_env_takes_only_ucx_variables():
    with pytest.raises(ValueError, match="ucx_env keys must be UCX_"):
        NixlCheckpointEngine(1 << 20, ucx_env={"NCCL_DEBUG": "INFO"})


def test_ucx_devices_needs_the_ucx_plugin():
    with pytest.raises(ValueError, match="ucx_devices applies to the UCX plugin"):
        NixlCheckpointEngine(1 << 20, plugin="LIBFABRIC", ucx_devices="mlx5_0:1")


def test_unknown_plugin_and_parameters_name_what_exists():
    with pytest.raises(WeightSyncError, match=r"no backend plugin 'NOPE'.*available: .*UCX"):
        NixlTransport("NOPE")
    with pytest.raises(WeightSyncError, match=r"no parameter.*bogus.*accepts: .*num_workers"):
        NixlTransport("UCX", {"bogus": "1"})


def test_write_and_read_between_two_agents_move_real_bytes():
    first, second = NixlTransport(), NixlTransport()
    try:
        source = torch.arange(1 << 16, dtype=torch.int64).view(torch.uint8)
        target = torch.zeros_like(source)
        back = torch.zeros_like(source)
        first.register(source)
        first.register(back)
        remote = second.register(target)
        peer = first.connect(second.metadata())
        first.write(peer, source, remote, timeout=30)
        assert torch.equal(source, target)
        first.read(peer, back, remote, timeout=30)
        assert torch.equal(back, source)
        with pytest.raises(ValueError, match="bytes"):
            first.write(peer, source[:10], remote, timeout=30)
    finally:
        first.close()
        second.close()
