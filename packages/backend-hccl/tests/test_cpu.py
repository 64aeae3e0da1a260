"""Without torch_npu the registry shows why hccl cannot load and what to install."""

import importlib.util

import pytest

from weightsync_core import BackendLoadError, CheckpointEngineRegistry

no_torch_npu = pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed"
)


@no_torch_npu
def test_missing_torch_npu_is_named_with_the_fix():
    with pytest.raises(BackendLoadError) as info:
        CheckpointEngineRegistry.get("hccl")
    message = str(info.value)
    assert "weightsync-hccl" in message
    assert "torch_npu" in message
    assert "pip install torch-npu" in message


@no_torch_npu
def test_backends_listing_reports_hccl_as_broken_with_the_reason():
    row = CheckpointEngineRegistry.available(probe=True)["hccl"]
    assert row.state.value == "broken"
    assert "torch_npu" in row.reason
