"""Shared test set-up for weightsync-core: one local Ray instance per session, and processes
for the tests that run gloo groups of their own outside Ray."""

import multiprocessing
from multiprocessing.context import ForkServerContext
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


@pytest.fixture
def clean_processes(monkeypatch, pytestconfig) -> ForkServerContext:
    """A multiprocessing context whose processes fork from a server that never ran Ray.

    This process is a Ray driver: a child forked from it inherits the driver's gRPC
    connections, and a clean-clone CI run hung once the driver's calls to Ray's GCS stopped
    being answered right after a test forked it. The targets and arguments of these
    processes are pickled, so they must be module-level functions of a test module (which
    the children import as ``packages.core.tests.<module>``, from the root on ``sys.path``).
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "weightsync_core"])
    monkeypatch.syspath_prepend(str(pytestconfig.rootpath))
    return context
