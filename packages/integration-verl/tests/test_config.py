"""verl's configuration seen by weightsync (no Ray needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from verl.checkpoint_engine import CheckpointEngineRegistry as VerlRegistry
from verl.workers.config import CheckpointEngineConfig

import weightsync_verl
from weightsync_verl import CheckpointEngineManager, weightsync_config


def test_importing_the_package_registers_every_installed_backend_in_verl():
    for name in ("weightsync_gloo", "weightsync_nixl", "weightsync_mooncake", "weightsync_kimi"):
        assert name in weightsync_verl.REGISTERED_BACKENDS
        engine_cls = VerlRegistry.get(name)
        assert issubclass(engine_cls, weightsync_verl.WeightsyncCheckpointEngine)
    assert "weightsync_naive" not in weightsync_verl.REGISTERED_BACKENDS  # verl has its own


def test_verl_config_becomes_weightsyncs():
    config = CheckpointEngineConfig(
        backend="weightsync_nixl", update_weights_bucket_megabytes=64,
        engine_kwargs={"weightsync_nixl": {"timeout": 42, "verify": False, "plugin": "UCX"}},
        custom_backend_module="weightsync_verl",
    )
    converted = weightsync_config(config)
    assert converted.backend == "nixl" and converted.update_weights_bucket_megabytes == 64
    # timeout, verify and rollout_dtype are settings of weightsync's config, not engine options
    assert converted.engine_kwargs == {"nixl": {"plugin": "UCX"}}
    assert converted.sync_timeout_seconds == 42 and converted.verify is False
    assert converted.custom_backend_module is None  # it registers into verl, not weightsync


def test_delta_in_the_engine_kwargs_is_refused_under_weightsyncs_manager_naming_way_1():
    config = CheckpointEngineConfig(
        backend="weightsync_gloo",
        engine_kwargs={"weightsync_gloo": {"delta": True, "full_verify_every": 3}},
        custom_backend_module="weightsync_verl",
    )
    with pytest.raises(ValueError, match=r"delta, full_verify_every: .* verl's own checkpoint "
                       r"manager \(way 1\)"):
        weightsync_config(config)


def test_full_verify_every_of_the_adapter_engines_is_checked_when_built():
    engine_cls = VerlRegistry.get("weightsync_gloo")
    with pytest.raises(ValueError, match="full_verify_every must be an integer >= 0"):
        engine_cls(1 << 20, delta=True, full_verify_every=-1)


def test_full_verify_every_without_delta_is_refused_by_the_adapter_engines():
    engine_cls = VerlRegistry.get("weightsync_gloo")
    with pytest.raises(ValueError, match=r"full_verify_every=3 applies to delta sync only, and "
                       r"delta is off .*: set delta=True in the engine_kwargs as well"):
        engine_cls(1 << 20, full_verify_every=3)


def _empty_actor_wg() -> SimpleNamespace:
    """The shape of verl's actor worker group, without workers."""
    return SimpleNamespace(workers=[], execute_checkpoint_engine=lambda *args, **kwargs: [])


def test_a_backend_that_is_not_weightsyncs_is_refused_with_the_names_to_use():
    with pytest.raises(ValueError, match="weightsync_nixl"):
        CheckpointEngineManager(CheckpointEngineConfig(backend="nccl"),
                                _empty_actor_wg(), [])


def test_an_unknown_weightsync_backend_is_a_value_error_as_verl_callers_expect():
    with pytest.raises(ValueError, match="nope"):
        CheckpointEngineManager(CheckpointEngineConfig(backend="weightsync_nope"),
                                _empty_actor_wg(), [])


def test_an_actor_group_without_checkpoint_engines_is_refused_naming_what_to_pass():
    with pytest.raises(TypeError, match="has no execute_checkpoint_engine"):
        CheckpointEngineManager(CheckpointEngineConfig(backend="weightsync_gloo"),
                                SimpleNamespace(workers=[]), [])
