"""The import paths of core's modules before they moved into their layer's folder keep working
for one minor version, with a warning, and give the very module that lives at the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from weightsync_core._old_paths import MOVED

_FRESH_IMPORTS = """
import importlib, warnings
from weightsync_core._old_paths import MOVED
warnings.simplefilter("error", DeprecationWarning)
for old, new in MOVED.items():
    module = importlib.import_module(f"weightsync_core.{new}")
    assert module.__spec__.name == f"weightsync_core.{new}", module.__spec__.name
warnings.simplefilter("always", DeprecationWarning)
with warnings.catch_warnings(record=True) as caught:
    from weightsync_core.shards import DecoderShape
    import weightsync_core.delta.codec as codec
    import weightsync_core.manager as manager
import weightsync_core.data.delta.codec, weightsync_core.data.shards
assert codec is weightsync_core.data.delta.codec
assert DecoderShape is weightsync_core.data.shards.DecoderShape
assert manager.__spec__.name == "weightsync_core.orchestration.manager"
print(sorted({str(w.message).split()[0] for w in caught}))
"""


def test_every_old_path_names_a_module_that_exists():
    for new in MOVED.values():
        assert importlib.util.find_spec(f"weightsync_core.{new}") is not None, new


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_gives_the_module_at_its_new_path(old):
    new = importlib.import_module(f"weightsync_core.{MOVED[old]}")
    sys.modules.pop(f"weightsync_core.{old}", None)
    with pytest.warns(DeprecationWarning, match=rf"weightsync_core\.{old} moved to "
                                                 rf"weightsync_core\.{MOVED[old]}"):
        module = importlib.import_module(f"weightsync_core.{old}")
    assert module is new
    assert module.__spec__.name == new.__name__  # its own spec, not the alias's


def test_old_packages_give_their_submodules_once_and_new_imports_never_warn():
    done = subprocess.run([sys.executable, "-c", _FRESH_IMPORTS], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("['weightsync_core.delta', 'weightsync_core.delta.codec', "
                                   "'weightsync_core.manager', 'weightsync_core.shards']")


def test_patching_through_an_old_path_patches_the_module(monkeypatch):
    from weightsync_core.api import hosts

    sys.modules.pop("weightsync_core.options", None)
    with pytest.warns(DeprecationWarning):
        old = importlib.import_module("weightsync_core.options")
    monkeypatch.setattr(old, "HOST_ENV", "PATCHED")
    assert importlib.import_module("weightsync_core.api.options").HOST_ENV == "PATCHED"
    assert hosts.HOST_ENV == "WEIGHTSYNC_HOST"
