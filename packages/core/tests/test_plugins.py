"""The custom_backend_module and checkpoint_manager_class loading policy."""

import pytest

from weightsync_core import (
    CheckpointEngineConfig,
    CheckpointEngineManager,
    CheckpointEngineRegistry,
    PluginError,
    load_checkpoint_manager_class,
    load_custom_backend_module,
)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("/tmp/evil.py", "looks like a file path"),
        ("plugins/backend", "looks like a file path"),
        ("backend.py", "looks like a file path"),
        ("C:\\plugins\\backend", "looks like a file path"),
        ("https://example.com/backend.py", "looks like a URL"),
        (".relative.module", "is a relative module name"),
        ("my-package.backend", "is not a valid dotted Python module name"),
        ("", "must be a dotted module name"),
    ],
)
def test_non_dotted_names_are_refused(value, problem):
    with pytest.raises(PluginError, match=problem):
        load_custom_backend_module(value)


def test_none_loads_nothing():
    assert load_custom_backend_module(None) == []


def test_module_outside_the_project_registers_its_backends(external_plugins_on_path):
    registered = load_custom_backend_module("acme_weightsync")
    assert registered == ["acme_corrupting_gloo", "acme_gloo"]
    assert CheckpointEngineRegistry.get("acme_gloo").__module__ == "acme_weightsync"
    assert load_custom_backend_module(["acme_weightsync"]) == registered  # idempotent


def test_module_that_registers_nothing_is_an_error(external_plugins_on_path):
    with pytest.raises(PluginError, match="registered no backend"):
        load_custom_backend_module("acme_empty")


def test_missing_module_is_an_error():
    with pytest.raises(PluginError, match="could not be imported"):
        load_custom_backend_module("acme_does_not_exist")


def test_operator_allowlist_refuses_other_prefixes(monkeypatch, external_plugins_on_path):
    monkeypatch.setenv("WEIGHTSYNC_TRUSTED_MODULES", "my_company, other_corp.plugins")
    with pytest.raises(PluginError, match="WEIGHTSYNC_TRUSTED_MODULES=my_company,other_corp"):
        load_custom_backend_module("acme_weightsync")
    with pytest.raises(PluginError, match="not allowed"):
        load_checkpoint_manager_class("acme_managers.CountingManager")
    with pytest.raises(PluginError, match="not allowed"):
        load_custom_backend_module("my_company_evil")  # a prefix must match a whole name


def test_a_module_the_allowlist_refuses_fails_when_the_config_is_built(monkeypatch):
    """Before any worker starts (and whether or not the module imports on the driver)."""
    monkeypatch.setenv("WEIGHTSYNC_TRUSTED_MODULES", "my_company")
    for module in ("acme_weightsync", ["my_company.backend", "acme_does_not_exist"]):
        with pytest.raises(PluginError, match="is not allowed"):
            CheckpointEngineConfig(backend="acme_gloo", custom_backend_module=module)
    with pytest.raises(PluginError, match="looks like a file path"):
        CheckpointEngineConfig(backend="acme_gloo", custom_backend_module="/tmp/evil.py")


def test_operator_allowlist_admits_listed_prefixes(monkeypatch, external_plugins_on_path):
    monkeypatch.setenv("WEIGHTSYNC_TRUSTED_MODULES", "acme_weightsync,acme_managers")
    assert "acme_gloo" in load_custom_backend_module("acme_weightsync")
    assert load_checkpoint_manager_class("acme_managers.CountingManager").__name__ == (
        "CountingManager"
    )


def test_manager_class_hook(external_plugins_on_path):
    assert load_checkpoint_manager_class(None) is CheckpointEngineManager
    counting = load_checkpoint_manager_class("acme_managers:CountingManager")
    assert issubclass(counting, CheckpointEngineManager)
    with pytest.raises(PluginError, match=r"not a subclass of .*CheckpointEngineManager"):
        load_checkpoint_manager_class("acme_managers.NotAManager")
    with pytest.raises(PluginError, match="has no attribute"):
        load_checkpoint_manager_class("acme_managers.Missing")
    with pytest.raises(PluginError, match="fully qualified"):
        load_checkpoint_manager_class("CountingManager")
    with pytest.raises(PluginError, match="file path"):
        load_checkpoint_manager_class("/tmp/acme_managers.CountingManager")


def test_the_driver_allowlist_travels_with_the_config_and_no_file_can_set_it(monkeypatch):
    import dataclasses
    import pickle

    from weightsync_core import convert
    from weightsync_core.api.conversion import ConversionError

    monkeypatch.setenv("WEIGHTSYNC_TRUSTED_MODULES", "my_company, other_corp.plugins")
    config = CheckpointEngineConfig(backend="gloo")
    assert config.trusted_modules == ("my_company", "other_corp.plugins")
    monkeypatch.delenv("WEIGHTSYNC_TRUSTED_MODULES")
    carried = pickle.loads(pickle.dumps(config))  # as Ray hands it to a worker
    assert carried.trusted_modules == ("my_company", "other_corp.plugins")
    assert "trusted_modules" not in dataclasses.asdict(config)  # a dict of it, a file: none
    assert CheckpointEngineConfig(backend="gloo").trusted_modules is None
    with pytest.raises(TypeError, match="trusted_modules"):
        CheckpointEngineConfig(backend="gloo", trusted_modules=("acme_weightsync",))  # pyright: ignore[reportCallIssue]
    with pytest.raises(ConversionError, match="unknown key 'trusted_modules'"):
        convert({"backend": "gloo", "trusted_modules": ["acme"]}, CheckpointEngineConfig)
    with pytest.raises(AttributeError):
        config.trusted_modules = None  # pyright: ignore[reportAttributeAccessIssue]


def test_a_process_applies_the_driver_allowlist_beside_its_own(monkeypatch,
                                                               external_plugins_on_path):
    monkeypatch.delenv("WEIGHTSYNC_TRUSTED_MODULES", raising=False)  # this process: none
    with pytest.raises(PluginError, match=(
        r"WEIGHTSYNC_TRUSTED_MODULES=my_company in the driver's environment \(carried to this "
        r"process by the CheckpointEngineConfig built there")):
        load_custom_backend_module("acme_weightsync", trusted=("my_company",))
    assert "acme_gloo" in load_custom_backend_module("acme_weightsync", ("acme_weightsync",))
    monkeypatch.setenv("WEIGHTSYNC_TRUSTED_MODULES", "my_company")  # both lists must allow it
    with pytest.raises(PluginError, match=r"WEIGHTSYNC_TRUSTED_MODULES=my_company\. Ask"):
        load_custom_backend_module("acme_weightsync", ("acme_weightsync",))


def test_an_allowlist_set_after_the_config_was_built_binds_the_processes_it_is_sent_to(
        monkeypatch, external_plugins_on_path):
    """The driver builds the config (and imports the module) before the operator sets the
    allowlist; a worker whose environment predates the variable builds its engine from the
    config Ray pickled after it was set."""
    import pickle

    from weightsync_core.worker import build_engine

    monkeypatch.delenv("WEIGHTSYNC_TRUSTED_MODULES", raising=False)
    config = CheckpointEngineConfig(backend="acme_gloo", custom_backend_module="acme_weightsync",
                                    update_weights_bucket_megabytes=1)
    assert config.trusted_modules is None
    monkeypatch.setenv("WEIGHTSYNC_TRUSTED_MODULES", "my_company")  # in the driver only
    sent = pickle.dumps(config)  # as Ray hands it to a worker
    monkeypatch.delenv("WEIGHTSYNC_TRUSTED_MODULES")  # the worker's environment
    carried = pickle.loads(sent)
    assert carried.trusted_modules == ("my_company",) and carried == config
    with pytest.raises(PluginError, match=(
            r"custom_backend_module='acme_weightsync' is not allowed: the operator restricted "
            r"loadable modules with WEIGHTSYNC_TRUSTED_MODULES=my_company in the driver's "
            r"environment")):
        build_engine(carried)


def test_the_lists_in_force_where_a_config_was_built_and_where_it_was_sent_both_apply(
        monkeypatch, external_plugins_on_path):
    from weightsync_core.api.plugins import allowed_by_both

    assert allowed_by_both(("acme", "my_company.plugins"), ("acme.gloo", "my_company")) == (
        "acme.gloo", "my_company.plugins")
    assert allowed_by_both(None, ("acme",)) == ("acme",) == allowed_by_both(("acme",), None)
    assert allowed_by_both(None, None) is None
    assert allowed_by_both(("acme",), ("acme_weightsync",)) == ()
    with pytest.raises(PluginError, match=r"WEIGHTSYNC_TRUSTED_MODULES=\(no prefix both of its "
                                          r"lists allow\) in the driver's environment"):
        load_custom_backend_module("acme_weightsync", trusted=())


@pytest.mark.parametrize("module", ["weightsync_core", "weightsync_core.engines.gloo",
                                    ["acme_weightsync", "weightsync_core.engines"]])
def test_a_core_module_is_refused_as_a_custom_backend_module(module, external_plugins_on_path):
    message = (r"is a module of weightsync_core, whose backends \((\w+, )*gloo(, \w+)*\) are "
               r"registered already: a core module registers nothing of its own. Drop it and "
               r"set backend=")
    with pytest.raises(PluginError, match=message):
        CheckpointEngineConfig(backend="gloo", custom_backend_module=module)
    with pytest.raises(PluginError, match=message):
        load_custom_backend_module(module)
