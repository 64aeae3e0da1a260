"""What can be checked without a GPU: registration, the missing-device message, topology,
option validation, and that group set-up is core's fail-fast path."""

from pathlib import Path

import pytest
import torch

from weightsync_core import CheckpointEngineRegistry, WeightSyncError
from weightsync_core.spi import CollectiveBroadcastCheckpointEngine
from weightsync_core.testing.docs import check_documented_options
from weightsync_nccl import NCCLCheckpointEngine

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")


def meta(host, member, senders=1):
    return {"host": host, "port": 1, "member": member, "group": None, "senders": senders}


def test_registered_through_the_entry_point():
    assert CheckpointEngineRegistry.get("nccl") is NCCLCheckpointEngine
    assert CheckpointEngineRegistry.available()["nccl"].state.value == "loaded"


@no_cuda
def test_without_a_gpu_construction_says_what_is_missing_and_what_to_use():
    with pytest.raises(WeightSyncError, match=r"needs a cuda device.*backend='gloo'"):
        CheckpointEngineRegistry.new("nccl", bucket_size=1 << 20)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"senders": 0}, "'senders' must be a positive integer"),
     ({"group_init_timeout": -1}, "'group_init_timeout' must be > 0")],
)
def test_options_are_validated_before_the_device_is_needed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NCCLCheckpointEngine(1 << 20, **kwargs)


def test_single_sender_topology():
    metadata = [meta("n0", "a0"), meta("n0", "a1"), meta("n1", "r0"), meta("n2", "r1")]
    actor, rollout = NCCLCheckpointEngine.build_topology(2, 2, metadata)
    assert actor["rank"] == [0, -1]
    assert rollout["rank"] == [1, 2]
    assert rollout["master_metadata"][0]["host"] == "n0"


def test_multi_sender_relays_only_on_the_sender_node():
    metadata = [meta("n0", "a0", senders=4), meta("n1", "a1", senders=4),
                meta("n0", "a2", senders=4), meta("n0", "a3", senders=4)]
    metadata += [meta(f"r{i}", f"r{i}") for i in range(6)]
    actor, rollout = NCCLCheckpointEngine.build_topology(4, 6, metadata)
    assert actor["rank"] == [0, -1, 0, 0]  # a1 is on another node: never a relay
    assert [m[0] for m in rollout["members"]] == ["a0", "a0", "a2", "a2", "a3", "a3"]


def test_group_setup_is_the_shared_fail_fast_path():
    """Group set-up (store, rendezvous naming missing ranks, reuse) is core's; the gloo
    engine's tests exercise it on CPU. NCCL only supplies the communicator."""
    assert NCCLCheckpointEngine.init_process_group is (
        CollectiveBroadcastCheckpointEngine.init_process_group
    )
    assert NCCLCheckpointEngine.new_data_group is not (
        CollectiveBroadcastCheckpointEngine.new_data_group
    )


def test_documented_options_are_options():
    readme = Path(__file__).parents[1] / "README.md"
    page = Path(__file__).parents[3] / "docs" / "backends" / "nccl.md"  # the docs site's
    assert len(check_documented_options(page, "nccl")) == 2
    assert len(check_documented_options(readme, "nccl")) == 1  # the quick start
