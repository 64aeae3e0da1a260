"""The ``mooncake`` engine's typed options, and the configs of its docs page and README built
against them."""

from pathlib import Path

import pytest

from weightsync_core import CheckpointEngineConfig, EngineOptionsError
from weightsync_core.testing.docs import check_documented_options

README = Path(__file__).parents[1] / "README.md"
DOCS = Path(__file__).parents[3] / "docs"
"""The documentation site's pages (the tests run from a repository checkout)."""


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"protocl": "rdma"}, "no option 'protocl' (given 'rdma'). Did you mean 'protocol'"),
    ({"protocol": ""}, "option 'protocol' must name a Transfer Engine protocol"),
    ({"slots": 1}, "option 'slots' must be an integer >= 2"),
    ({"keep_buffers": "yes"}, "option 'keep_buffers' must be True or False, got 'yes'"),
])
def test_bad_options_fail_when_the_config_is_built(kwargs, message):
    with pytest.raises(EngineOptionsError, match="backend 'mooncake'") as raised:
        CheckpointEngineConfig(backend="mooncake", engine_kwargs={"mooncake": kwargs})
    assert message in str(raised.value)


def test_documented_options_are_options():
    page = DOCS / "backends" / "mooncake.md"
    assert len(check_documented_options(page, "mooncake")) == 3  # mooncake_sharded too
    assert len(check_documented_options(README, "mooncake")) == 1  # the quick start
