"""Registration and option validation (a real NIXL agent where one is needed)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from weightsync_core import (
    CheckpointEngineConfig,
    CheckpointEngineRegistry,
    EngineOptionsError,
    WeightSyncError,
)
from weightsync_core.testing.docs import check_documented_options
from weightsync_nixl import NixlCheckpointEngine, NixlTransport
from weightsync_nixl.transport import host_has_efa, ucx_module_defaults

README = Path(__file__).parents[1] / "README.md"
DOCS = Path(__file__).parents[3] / "docs"
"""The documentation site's pages (the tests run from a repository checkout)."""


def test_registered_through_the_entry_point():
    assert CheckpointEngineRegistry.get("nixl") is NixlCheckpointEngine


def test_ucx_env_takes_only_ucx_variables():
    with pytest.raises(ValueError, match="'ucx_env' takes UCX_"):
        NixlCheckpointEngine(1 << 20, ucx_env={"NCCL_DEBUG": "INFO"})


def test_ucx_devices_needs_the_ucx_plugin():
    with pytest.raises(ValueError, match="'ucx_devices' applies to the UCX plugin"):
        NixlCheckpointEngine(1 << 20, plugin="LIBFABRIC", ucx_devices="mlx5_0:1")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"backend_plugin": "UCX"}, "no option 'backend_plugin' (given 'UCX'). Did you mean 'plugin'"),
    ({"num_threads": "2"}, "option 'num_threads' must be an integer, got '2'"),
    ({"device": "gpu"}, "option 'device' must be one of 'cpu', 'cuda', got 'gpu'"),
    ({"ucx_env": {"UCX_TLS": 1}}, "option 'ucx_env' must be a mapping of a string to a string"),
])
def test_bad_options_fail_when_the_config_is_built(kwargs, message):
    with pytest.raises(EngineOptionsError, match="backend 'nixl'") as raised:
        CheckpointEngineConfig(backend="nixl", engine_kwargs={"nixl": kwargs})
    assert message in str(raised.value)


def test_documented_options_are_options():
    # a dict, a dotted override, nixl_sharded's dict and the table
    assert len(check_documented_options(DOCS / "backends" / "nixl.md", "nixl")) == 4
    assert len(check_documented_options(README, "nixl")) == 1  # the quick start


def test_unknown_plugin_and_parameters_name_what_exists():
    with pytest.raises(WeightSyncError, match=r"no backend plugin 'NOPE'.*available: .*UCX"):
        NixlTransport("NOPE")
    with pytest.raises(WeightSyncError, match=r"no parameter.*bogus.*accepts: .*num_workers"):
        NixlTransport("UCX", {"bogus": "1"})


def test_write_and_read_between_two_agents_move_real_bytes():
    first, second = NixlTransport(), NixlTransport()
    try:
        source = torch.arange(1 << 16, dtype=torch.int64).view(torch.uint8)
        target = torch.zeros_like(source)
        back = torch.zeros_like(source)
        first.register(source)
        first.register(back)
        remote = second.register(target)
        peer = first.connect(second.metadata())
        first.write(peer, source, remote, timeout=30)
        assert torch.equal(source, target)
        first.read(peer, back, remote, timeout=30)
        assert torch.equal(back, source)
        with pytest.raises(ValueError, match="bytes"):
            first.write(peer, source[:10], remote, timeout=30)
    finally:
        first.close()
        second.close()


def test_a_process_that_used_an_agent_exits_cleanly():
    """With rdma-core installed on the host (CI installs it for Mooncake), UCX's efa module
    pulled in a second libnl and the process died with SIGSEGV at exit."""
    script = textwrap.dedent("""
        import torch
        from weightsync_nixl import NixlTransport
        first, second = NixlTransport(), NixlTransport()
        source = torch.ones(4096, dtype=torch.uint8)
        target = torch.zeros_like(source)
        first.register(source)
        remote = second.register(target)
        first.write(first.connect(second.metadata()), source, remote, timeout=30)
        assert torch.equal(source, target)
        first.close()
        second.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"


def test_efa_module_is_left_out_only_without_efa_devices(tmp_path, monkeypatch):
    monkeypatch.delenv("UCX_MODULES", raising=False)
    for name, driver in (("mlx5_0", "mlx5_core"), ("rdmap0", "efa")):
        (tmp_path / "drivers" / driver).mkdir(parents=True)
        (tmp_path / "class" / name / "device").mkdir(parents=True)
        (tmp_path / "class" / name / "device" / "driver").symlink_to(tmp_path / "drivers" / driver)
    assert host_has_efa(tmp_path / "class")
    (tmp_path / "class" / "rdmap0" / "device" / "driver").unlink()
    assert not host_has_efa(tmp_path / "class")
    assert not host_has_efa(tmp_path / "absent")
    assert ucx_module_defaults({}) == ({} if host_has_efa() else {"UCX_MODULES": "^efa"})
    assert ucx_module_defaults({"UCX_MODULES": "ib,tcp"}) == {}
    monkeypatch.setenv("UCX_MODULES", "*")
    assert ucx_module_defaults({}) == {}


def test_connected_agents_leave_the_cpu_idle_between_transfers():
    """NIXL's Python API starts each agent's progress thread polling without pause: one CPU
    core per process, busy for as long as the agent lives (a trainer and every replica,
    between syncs too)."""
    script = textwrap.dedent("""
        import os, time
        import torch
        from weightsync_nixl import NixlTransport
        first, second = NixlTransport(), NixlTransport()
        source = torch.ones(1 << 20, dtype=torch.uint8)
        target = torch.zeros_like(source)
        first.register(source)
        remote = second.register(target)
        first.write(first.connect(second.metadata()), source, remote, timeout=30)
        assert torch.equal(source, target)
        time.sleep(0.5)
        start, used = time.monotonic(), sum(os.times()[:2])
        time.sleep(2)
        print(f"{(sum(os.times()[:2]) - used) / (time.monotonic() - start):.3f}")
        first.close()
        second.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    cores = float(done.stdout.split()[-1])
    assert cores < 0.25, f"two idle, connected agents kept {cores:.2f} CPU cores busy"


def test_progress_delay_is_checked_before_an_agent_starts():
    with pytest.raises(EngineOptionsError, match="progress_delay_us"):
        CheckpointEngineConfig(backend="nixl", engine_kwargs={"nixl": {"progress_delay_us": -1}})


def test_an_unknown_plugin_fails_when_the_config_is_built_naming_those_offered():
    with pytest.raises(EngineOptionsError) as info:
        CheckpointEngineConfig(backend="nixl", engine_kwargs={"nixl": {"plugin": "NOPE"}})
    message = str(info.value)
    assert message.startswith("backend 'nixl': option 'plugin' must be a NIXL backend plugin "
                              "of this host's NIXL, got 'NOPE'.")
    assert "Plugins offered: " in message and "UCX" in message
    assert "fix engine_kwargs['nixl']['plugin']" in message
    with pytest.raises(EngineOptionsError, match=r"got 'ucx'\. Did you mean 'UCX'\?"):
        CheckpointEngineConfig(backend="nixl", engine_kwargs={"nixl": {"plugin": "ucx"}})
    from weightsync_nixl.options import available_plugins

    offered = available_plugins()
    assert offered is not None and "UCX" in offered
    CheckpointEngineConfig(backend="nixl", engine_kwargs={"nixl": {"plugin": sorted(offered)[0]}})


def test_without_nixl_in_the_process_the_plugin_is_left_to_where_the_engine_runs(monkeypatch):
    from weightsync_nixl import options as nixl_options
    from weightsync_nixl.options import NixlOptions

    monkeypatch.setattr(nixl_options, "available_plugins", lambda: None, raising=False)
    NixlOptions(plugin="NOPE")  # a driver without NIXL: the transport checks it in the worker
