"""CheckpointEngineRegistry: decorator, entry points, install hints, broken backends."""

import sys
import textwrap

import pytest

from weightsync_core import (
    BackendLoadError,
    BackendNotFoundError,
    BackendNotInstalledError,
    BackendRegistrationError,
    BackendState,
    CheckpointEngineRegistry,
)
from weightsync_core.engines import ColocatedCheckpointEngine, GlooCheckpointEngine


@pytest.fixture
def clean_registry():
    """Undo registrations and entry-point scans made by a test."""
    saved = dict(CheckpointEngineRegistry._registry), dict(CheckpointEngineRegistry._broken)
    yield CheckpointEngineRegistry
    CheckpointEngineRegistry._registry = saved[0]
    CheckpointEngineRegistry._broken = saved[1]
    CheckpointEngineRegistry.refresh()


def test_core_backends_resolve_through_entry_points():
    assert CheckpointEngineRegistry.get("gloo") is GlooCheckpointEngine
    assert CheckpointEngineRegistry.get("naive") is ColocatedCheckpointEngine


def test_missing_first_party_backend_names_the_package_to_install():
    with pytest.raises(BackendNotInstalledError) as info:
        CheckpointEngineRegistry.get("nixl")
    message = str(info.value)
    assert "weightsync-nixl" in message
    assert "pip install weightsync-nixl" in message
    assert "gloo" in message and "naive" in message  # what is available instead


def test_kimi_alias_names_its_package():
    with pytest.raises(BackendNotInstalledError, match="weightsync-kimi"):
        CheckpointEngineRegistry.get("kimi_ckpt_engine")


def test_unknown_backend_suggests_a_close_name():
    with pytest.raises(BackendNotFoundError, match="Did you mean 'gloo'"):
        CheckpointEngineRegistry.get("glooo")


def test_an_unknown_backend_is_also_a_value_error_as_verl_callers_expect():
    with pytest.raises(ValueError, match="glooo"):
        CheckpointEngineRegistry.get("glooo")


def test_new_builds_an_instance():
    engine = CheckpointEngineRegistry.new("gloo", bucket_size=1 << 20)
    assert isinstance(engine, GlooCheckpointEngine)
    assert engine.bucket_size == 1 << 20


def test_decorator_registers_and_refuses_a_different_class_under_a_taken_name(clean_registry):
    @clean_registry.register("unit_test_engine")
    class First(GlooCheckpointEngine):
        pass

    assert clean_registry.register("unit_test_engine")(First) is First  # same class: fine
    assert clean_registry.get("unit_test_engine") is First

    class Second(GlooCheckpointEngine):
        pass

    with pytest.raises(BackendRegistrationError, match="already registered"):
        clean_registry.register("unit_test_engine")(Second)


def test_registering_a_non_engine_is_refused(clean_registry):
    with pytest.raises(BackendRegistrationError, match="not a subclass"):
        clean_registry.register("not_an_engine")(dict)


def test_available_reports_every_known_backend_with_its_state():
    report = CheckpointEngineRegistry.available()
    for name in ("naive", "gloo", "nccl", "hccl", "nixl", "mooncake", "kimi", "kimi_ckpt_engine"):
        assert name in report
    assert report["gloo"].state in (BackendState.LOADED, BackendState.INSTALLED)
    assert report["nixl"].state is BackendState.NOT_INSTALLED
    assert report["nixl"].distribution == "weightsync-nixl"
    assert "pip install weightsync-nixl" in report["nixl"].install_hint


def test_installed_backend_whose_native_library_fails_shows_the_import_error(
    tmp_path, monkeypatch, clean_registry
):
    """A real distribution on sys.path whose backend module imports a missing native lib."""
    dist_info = tmp_path / "acme_native-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-native\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        "[weightsync.backends]\nacme_native = acme_native_backend:Engine\n"
    )
    (tmp_path / "acme_native_backend.py").write_text(textwrap.dedent("""
        import libacme_transport_does_not_exist  # the native library
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    clean_registry.refresh()
    assert clean_registry.available()["acme_native"].state is BackendState.INSTALLED
    with pytest.raises(BackendLoadError) as info:
        clean_registry.get("acme_native")
    message = str(info.value)
    assert "acme-native" in message
    assert "libacme_transport_does_not_exist" in message
    row = clean_registry.available()["acme_native"]
    assert row.state is BackendState.BROKEN
    assert "libacme_transport_does_not_exist" in row.reason
    sys.modules.pop("acme_native_backend", None)


def test_a_first_party_backend_installed_but_failing_to_load_gets_no_install_hint(
    tmp_path, monkeypatch, clean_registry, capsys
):
    """Like hccl without torch_npu: its distribution is installed, so `pip install` it is
    the wrong advice; the load error (with its own fix) is what `weightsync backends` shows."""
    from weightsync_core.api import registry
    from weightsync_core.cli import main

    dist_info = tmp_path / "acme_native-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-native\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        "[weightsync.backends]\nacme_native = acme_native_backend:Engine\n"
    )
    (tmp_path / "acme_native_backend.py").write_text(
        "raise ImportError('acme needs libacme: install it with your package manager')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(
        registry.KNOWN_BACKENDS, "acme_native",  # type: ignore[index]
        registry.KnownBackend("acme-native", "a first-party backend", "libacme"),
    )
    clean_registry.refresh()
    row = clean_registry.available(probe=True)["acme_native"]
    assert row.state is BackendState.BROKEN
    assert row.install_hint is None
    assert "install it with your package manager" in row.reason
    assert main(["backends"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("acme_native "))
    assert "install it with your package manager" in line
    assert "pip install acme-native" not in line
    assert "uv add" not in line
    sys.modules.pop("acme_native_backend", None)
