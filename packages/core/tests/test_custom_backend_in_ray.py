"""A backend from a module outside the project, named only in custom_backend_module, is used
by the driver and inside every Ray worker process; verification catches a corrupting one."""

import pytest
import ray

from weightsync_core import CheckpointEngineConfig, CheckpointEngineWorker, SyncStageError
from weightsync_core.testing import SyncHarness
from weightsync_core.testing.actors import WeightSourceActor


def config(backend):
    return CheckpointEngineConfig(
        backend=backend, custom_backend_module="acme_weightsync",
        update_weights_bucket_megabytes=1, sync_timeout_seconds=30,
    )


def test_custom_backend_is_registered_and_used_in_every_process(external_plugins_on_path):
    harness = SyncHarness(config("acme_gloo"), actor_world_size=1, replica_sizes=(1,))
    try:
        manager = harness.manager()
        assert manager.backend_cls.__module__ == "acme_weightsync"
        expected = harness.set_weights(seed=31)
        manager.update_weights_sync(global_steps=31)
        [report] = harness.reports()
        assert report["received"] == expected
        assert report["engine_class"] == "acme_weightsync.AcmeGlooEngine"
        actor_report = ray.get(harness.actors[0].report.remote())
        assert actor_report["engine_class"] == "acme_weightsync.AcmeGlooEngine"
    finally:
        harness.shutdown()


def test_corruption_in_transit_fails_the_sync_naming_the_tensor(external_plugins_on_path):
    harness = SyncHarness(config("acme_corrupting_gloo"), actor_world_size=1, replica_sizes=(1,))
    try:
        harness.set_weights(seed=32)
        with pytest.raises(SyncStageError) as info:
            harness.manager().update_weights_sync(global_steps=32)
        message = str(info.value)
        assert "VerificationError" in message
        assert "model.embed.weight" in message
        assert "rollout rank 0" in message
    finally:
        harness.shutdown()


def test_path_like_custom_backend_module_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="looks like a file path"):
        SyncHarness(
            CheckpointEngineConfig(backend="gloo", custom_backend_module="./acme_weightsync.py")
        )


def test_an_engine_written_for_verl_runs_with_only_its_base_import_changed(
    external_plugins_on_path,
):
    # verl_style_engine.py is written as verl writes engines (own constructor, no stats from
    # send_weights, verl's chunk helpers); tensors several buckets long are split and merged
    config = CheckpointEngineConfig(
        backend="verl_style_gloo", custom_backend_module="verl_style_engine",
        update_weights_bucket_megabytes=1, sync_timeout_seconds=30,
        engine_kwargs={"verl_style_gloo": {"rebuild_group": True}},
    )
    harness = SyncHarness(config, actor_world_size=2, replica_sizes=(1, 2))
    try:
        for step in (41, 42):
            expected = harness.set_weights(seed=step)
            metrics = harness.manager().update_weights(step)  # from synchronous code
            assert metrics["weightsync/tensors"] == len(expected)
            for report in harness.reports():
                assert report["received"] == expected
                assert report["global_steps"][-1] == step
    finally:
        harness.shutdown()


def test_the_driver_allowlist_binds_workers_that_started_before_it_was_set(monkeypatch):
    """Ray (and its workers' environment) is up before the operator sets the allowlist in
    the driver: the workers never see the variable, but get it with the config."""
    assert ray.is_initialized()
    monkeypatch.setenv("WEIGHTSYNC_TRUSTED_MODULES", "my_company")
    config = CheckpointEngineConfig(backend="gloo", update_weights_bucket_megabytes=1)
    # the config is a mutable dataclass: changed after the driver checked it, nothing on the
    # driver checks it again before the workers start and import the module
    config.backend, config.custom_backend_module = "acme_gloo", "acme_weightsync"
    rollout = ray.remote(CheckpointEngineWorker).options(num_cpus=0).remote(config)
    with pytest.raises(ray.exceptions.RayActorError) as info:
        ray.get(rollout.weights_status.remote(), timeout=120)
    message = str(info.value)
    assert "PluginError: custom_backend_module='acme_weightsync' is not allowed" in message
    assert "WEIGHTSYNC_TRUSTED_MODULES=my_company in the driver's environment" in message
    # the actor side builds its engine the same way
    actor = ray.remote(WeightSourceActor).options(num_cpus=0).remote(config)
    with pytest.raises(ray.exceptions.RayActorError, match="is not allowed"):
        ray.get(actor.report.remote(), timeout=120)
