"""How the registry reports the backend, loadable or not."""

import subprocess
import sys

from weightsync_core import CheckpointEngineRegistry
from weightsync_mooncake import MooncakeCheckpointEngine


def test_registered_through_the_entry_point():
    assert CheckpointEngineRegistry.get("mooncake") is MooncakeCheckpointEngine


def test_missing_transfer_engine_shows_the_loader_error_and_the_fix():
    """With the `mooncake` module unloadable, the registry names the error and the extras."""
    code = (
        "import sys; sys.modules['mooncake'] = None; sys.modules['mooncake.engine'] = None\n"
        "from weightsync_core import CheckpointEngineRegistry\n"
        "try:\n"
        "    CheckpointEngineRegistry.get('mooncake')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.startswith("BackendLoadError")
    assert "could not load Mooncake Transfer Engine" in out
    assert "weightsync-mooncake[non-cuda]" in out
    assert "libibverbs1 librdmacm1 libnuma1" in out
    assert "[cuda12]" in out and "[cuda13]" in out


def test_bad_protocol_is_refused_with_a_clear_message():
    import pytest

    with pytest.raises(ValueError, match="'protocol' must name a Transfer Engine protocol"):
        MooncakeCheckpointEngine(1 << 20, protocol="")
