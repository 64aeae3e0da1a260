"""One local Ray instance per test session; test-only plugins importable everywhere."""

import os
import sys
from pathlib import Path

import pytest

from weightsync_core.testing import ensure_ray

EXTERNAL_PLUGINS = Path(__file__).parent / "external_plugins"

# the driver imports the plugin modules by dotted name, like a user's own package; the tests
# share trainer_test_helpers
sys.path[:0] = [str(EXTERNAL_PLUGINS), str(Path(__file__).parent)]


@pytest.fixture(scope="session", autouse=True)
def ray_session():
    """Ray on loopback; worker processes get the plugin directory on PYTHONPATH."""
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ensure_ray(num_cpus=2, env_vars={"PYTHONPATH": str(EXTERNAL_PLUGINS)})
    yield
