"""The ``kimi`` engine's typed options, and the configs of its docs page and README built
against them."""

from pathlib import Path

import pytest

from weightsync_core import CheckpointEngineConfig, EngineOptionsError
from weightsync_core.testing.docs import check_documented_options

README = Path(__file__).parents[1] / "README.md"
DOCS = Path(__file__).parents[3] / "docs"
"""The documentation site's pages (the tests run from a repository checkout)."""


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"collective": "mooncake"}, "option 'collective' must name a broadcast backend"),
    ({"collective_kwargs": {"sendrs": 2}},
     "option 'collective_kwargs': backend 'gloo' has no option 'sendrs'"),
    ({"collective_kwargs": {"rebuild_group": "no"}},
     "option 'collective_kwargs': backend 'gloo': option 'rebuild_group' must be True or False"),
    ({"rebuild_group": 1}, "option 'rebuild_group' must be True or False, got 1"),
])
def test_bad_options_fail_when_the_config_is_built(kwargs, message):
    with pytest.raises(EngineOptionsError, match="backend 'kimi'") as raised:
        CheckpointEngineConfig(backend="kimi", engine_kwargs={"kimi": kwargs})
    assert message in str(raised.value)


def test_documented_options_are_options():
    assert len(check_documented_options(DOCS / "backends" / "kimi.md", "kimi")) == 2
    assert len(check_documented_options(README, "kimi")) == 1  # the quick start


def test_a_collective_unknown_everywhere_is_refused_with_the_close_name():
    with pytest.raises(EngineOptionsError) as raised:
        CheckpointEngineConfig(backend="kimi", engine_kwargs={"kimi": {"collective": "ncll"}})
    assert "unknown checkpoint-engine backend 'ncll'. Did you mean 'nccl'?" in str(raised.value)


def test_a_collective_this_process_cannot_load_is_left_to_the_kimi_engine():
    # hccl is known everywhere but loads nowhere here (no torch_npu, or weightsync-hccl is not
    # installed): the driver cannot check its options, the engine fails where it runs.
    config = CheckpointEngineConfig(
        backend="kimi", engine_kwargs={"kimi": {"collective": "hccl", "collective_kwargs": {}}})
    assert config.active_engine_kwargs["collective"] == "hccl"
