"""Shared test set-up for weightsync-core: one local Ray instance per session."""

from pathlib import Path

import pytest

from weightsync_core.testing import ensure_ray

EXTERNAL_PLUGINS = Path(__file__).parent / "external_plugins"


@pytest.fixture(scope="session", autouse=True)
def ray_session():
    """Ray on loopback; worker processes can import the external plugin modules."""
    ensure_ray(num_cpus=2, env_vars={"PYTHONPATH": str(EXTERNAL_PLUGINS)})
    yield


@pytest.fixture
def external_plugins_on_path(monkeypatch):
    """Make the external plugin modules importable in this (driver) process."""
    monkeypatch.syspath_prepend(str(EXTERNAL_PLUGINS))
