"""weightsync-kimi 0.0.1 installs beside core and says clearly that it has no engine yet."""

import importlib.metadata

import pytest

import weightsync_kimi
from weightsync_core import BackendNotInstalledError, CheckpointEngineRegistry


def test_installed_with_its_own_version():
    assert importlib.metadata.version("weightsync-kimi") == "0.0.1"
    assert weightsync_kimi.__all__ == []


def test_registry_says_this_release_does_not_provide_the_backend():
    expected = "not provided by the installed weightsync-kimi 0.0.1"
    with pytest.raises(BackendNotInstalledError, match=expected):
        CheckpointEngineRegistry.get("kimi")


def test_available_reports_the_installed_release_without_the_backend():
    row = CheckpointEngineRegistry.available()["kimi"]
    assert row.state.value == "not installed"
    assert row.reason == "weightsync-kimi 0.0.1 is installed but does not provide it"
