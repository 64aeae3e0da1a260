"""Device tests: run only where Ascend NPUs and torch_npu exist (skipped elsewhere)."""

import importlib.util

import pytest

from weightsync_core.testing import (
    AdapterSyncConformanceTests,
    CheckpointEngineConformanceTests,
    DeltaSyncConformanceTests,
)


def _npus() -> int:
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    import torch
    import torch_npu  # noqa: F401

    return torch.npu.device_count()


@pytest.mark.skipif(_npus() < 2, reason="needs torch_npu and 2+ Ascend NPUs")
class TestHCCLConformance(CheckpointEngineConformanceTests, DeltaSyncConformanceTests,
                          AdapterSyncConformanceTests):
    backend = "hccl"
    actor_world_size = 1
    replica_sizes = (1,)
    ray_actor_options = {"resources": {"NPU": 1}}  # noqa: RUF012
