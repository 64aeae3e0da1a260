"""weightsync-trainer 0.0.1 installs beside core."""

import importlib.metadata

import weightsync_core
import weightsync_trainer


def test_installed_with_its_own_version_beside_core():
    assert importlib.metadata.version("weightsync-trainer") == "0.0.1"
    assert weightsync_trainer.__all__ == []
    assert weightsync_core.CheckpointEngineManager.__name__ == "CheckpointEngineManager"
