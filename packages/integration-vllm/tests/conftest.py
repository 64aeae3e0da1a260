"""One local Ray instance per test session; the test actors importable in Ray workers."""

import sys
from pathlib import Path

import pytest

from weightsync_core.testing import ensure_ray

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="session", autouse=True)
def ray_session():
    """Ray on loopback (vLLM's engines start their own processes beside the actors)."""
    ensure_ray(num_cpus=4, env_vars={"PYTHONPATH": str(TESTS)})
    yield
