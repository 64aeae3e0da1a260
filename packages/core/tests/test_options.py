"""Engine options are typed and checked on the driver, before any process starts."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import ray

from weightsync_core import CheckpointEngineConfig, CheckpointEngineManager, CheckpointEngineWorker
from weightsync_core.api.errors import EngineOptionsError
from weightsync_core.api.options import EngineOptions, parse_options
from weightsync_core.engines import RingOptions
from weightsync_core.testing.docs import check_documented_options
from weightsync_core.worker import build_engine

GLOO_PAGE = Path(__file__).parents[3] / "docs" / "backends" / "gloo.md"
"""The docs site's page of gloo's options (the tests run from a repository checkout)."""
NOT_HERE = "192.0.2.1"
"""An address no machine holds (TEST-NET-1, reserved for documentation by RFC 5737)."""


@dataclass(frozen=True)
class _Options(EngineOptions):
    flag: bool = False
    count: int = 1
    seconds: float = 1.0
    mode: Literal["a", "b"] = "a"
    env: Mapping[str, str] = field(default_factory=dict)
    name: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.count < 1:
            raise ValueError(f"option 'count' must be >= 1, got {self.count}")


@pytest.mark.parametrize(("given", "message"), [
    ({"flag": "false"}, "'flag' must be True or False, got 'false' (str)"),
    ({"count": True}, "'count' must be an integer, got True (bool)"),
    ({"count": 2.0}, "'count' must be an integer"),
    ({"seconds": "5"}, "'seconds' must be a number, got '5' (str)"),
    ({"mode": "c"}, "'mode' must be one of 'a', 'b', got 'c'"),
    ({"env": {"A": 1}}, "'env' must be a mapping of a string to a string"),
    ({"name": 3}, "'name' must be a string or None"),
    ({"cuont": 2}, "has no option 'cuont' (given 2). Did you mean 'count'?"),
    ({"count": 0}, "option 'count' must be >= 1, got 0"),
    ({"seconds": float("inf")}, "option 'seconds' must be a finite number, got inf"),
    ({"seconds": float("nan")}, "option 'seconds' must be a finite number, got nan"),
])
def test_refused_values_name_the_option_and_what_is_accepted(given, message):
    with pytest.raises(EngineOptionsError, match="backend 'demo'") as raised:
        parse_options(_Options, "demo", given)
    assert message in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_accepted_values_build_the_options():
    options = parse_options(_Options, "demo", {"flag": True, "seconds": 2, "env": {"A": "1"}})
    assert options == _Options(flag=True, seconds=2, env={"A": "1"})
    with pytest.raises(AttributeError):
        options.flag = False  # frozen


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rebuild_group": "false"}, "option 'rebuild_group' must be True or False, got 'false'"),
    ({"group_init_timeout": "5"}, "option 'group_init_timeout' must be a number, got '5'"),
    ({"sendrs": 2}, "Did you mean 'senders'?"),
    ({"senders": 0}, "option 'senders' must be a positive integer"),
    ({"group_init_timeout": float("inf")}, "option 'group_init_timeout' must be a finite number"),
    ({"direct_send_megabytes": float("nan")},
     "option 'direct_send_megabytes' must be a finite number, got nan"),
    ({"timeout": 5}, "set CheckpointEngineConfig.sync_timeout_seconds"),
])
def test_bad_engine_kwargs_fail_when_the_config_is_built(kwargs, message):
    with pytest.raises(EngineOptionsError, match="backend 'gloo'") as raised:
        CheckpointEngineConfig(backend="gloo", engine_kwargs={"gloo": kwargs})
    assert message in str(raised.value)


def test_the_manager_checks_the_options_again_before_any_process_starts():
    config = CheckpointEngineConfig(backend="gloo")
    config.engine_kwargs = {"gloo": {"keep_buffers": "no"}}  # changed after it was checked
    with pytest.raises(EngineOptionsError, match="'keep_buffers' must be True or False"):
        CheckpointEngineManager(config, actor_wg=None)


def test_engines_keep_their_checked_options():
    from weightsync_core import CheckpointEngineRegistry

    engine = CheckpointEngineRegistry.new("gloo", bucket_size=1 << 20, senders=2, host="127.0.0.1")
    assert engine.options.senders == 2 and engine.senders == 2 and engine.host == "127.0.0.1"
    with pytest.raises(EngineOptionsError, match="no option 'sender'"):
        CheckpointEngineRegistry.new("gloo", bucket_size=1 << 20, sender=2)


def test_an_engine_written_for_verl_is_checked_by_its_constructor(external_plugins_on_path):
    CheckpointEngineConfig(backend="verl_style_gloo", custom_backend_module="verl_style_engine",
                           engine_kwargs={"verl_style_gloo": {"rebuild_group": True}})
    with pytest.raises(EngineOptionsError, match="Did you mean 'rebuild_group'"):
        CheckpointEngineConfig(
            backend="verl_style_gloo", custom_backend_module="verl_style_engine",
            engine_kwargs={"verl_style_gloo": {"rebuild_groups": True}},
        )


def test_documented_options_are_options(tmp_path):
    # a dict for gloo, one for gloo_sharded, and the engine kwarg table
    assert len(check_documented_options(GLOO_PAGE, "gloo")) == 3
    wrong = tmp_path / "README.md"
    wrong.write_text('engine_kwargs={"gloo": {"backend_plugin": "UCX"}}\n\n'
                     "| engine kwarg | default |\n| --- | --- |\n| `sender` | 1 |\n")
    with pytest.raises(AssertionError, match=r"README\.md:1 gloo: the documented options"):
        check_documented_options(wrong, "gloo")
    wrong.write_text("| engine kwarg | default |\n| --- | --- |\n| `sender` | 1 |\n")
    with pytest.raises(AssertionError, match=r"names \['sender'\]"):
        check_documented_options(wrong, "gloo")


def test_a_host_of_no_interface_here_passes_the_driver_and_fails_where_the_engine_is_built():
    # the driver checks nothing machine-bound: a worker's address is not the driver's
    config = CheckpointEngineConfig(backend="gloo", engine_kwargs={"gloo": {"host": NOT_HERE}})
    with pytest.raises(EngineOptionsError) as info:
        build_engine(config)
    message = str(info.value)
    assert message.startswith(
        f"backend 'gloo': option 'host' (engine_kwargs['gloo']['host']) is '{NOT_HERE}', "
        "which this machine"
    )
    assert "EADDRNOTAVAIL" in message and "WEIGHTSYNC_HOST" in message


def test_weightsync_host_of_no_interface_here_is_refused_where_the_engine_is_built(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_HOST", NOT_HERE)
    config = CheckpointEngineConfig(backend="gloo")
    named = (r"WEIGHTSYNC_HOST \(this process's environment; option 'host' is not set\) is "
             r"'192\.0\.2\.1'")
    with pytest.raises(EngineOptionsError, match=named):
        build_engine(config)
    with pytest.raises(EngineOptionsError, match=r"backend 'nixl': WEIGHTSYNC_HOST"):
        RingOptions().check_local("nixl")
    RingOptions(host="127.0.0.1").check_local("nixl")  # the option wins over the variable
    EngineOptions().check_local("naive")  # binds nothing


def test_a_rollout_worker_given_a_host_of_no_interface_of_its_machine_fails_as_it_starts():
    config = CheckpointEngineConfig(backend="gloo", update_weights_bucket_megabytes=1,
                                    engine_kwargs={"gloo": {"host": NOT_HERE}})
    worker = ray.remote(CheckpointEngineWorker).options(num_cpus=0).remote(config)
    with pytest.raises(ray.exceptions.RayActorError) as info:
        ray.get(worker.weights_status.remote(), timeout=120)
    assert "EngineOptionsError: backend 'gloo': option 'host'" in str(info.value)


@pytest.mark.parametrize("chunk", [1e12, 65536.5, 1e-9, 0])
def test_a_chunk_of_the_sharded_backends_beyond_the_largest_bucket_or_below_a_byte_is_refused(
        chunk):
    from weightsync_core.engines.sharded_transport import ShardedTransportOptions

    message = (f"option 'chunk_megabytes' must be at least one byte (2**-20 MiB) and at most "
               f"65536 (64 GiB, the largest bucket), got {float(chunk)!r}")
    with pytest.raises(EngineOptionsError, match="backend 'gloo_sharded'") as raised:
        CheckpointEngineConfig(backend="gloo_sharded",
                               engine_kwargs={"gloo_sharded": {"chunk_megabytes": chunk}})
    assert message in str(raised.value)
    with pytest.raises(ValueError) as raised:  # nixl_sharded's and mooncake_sharded's base
        ShardedTransportOptions(chunk_megabytes=float(chunk))
    assert message in str(raised.value)


def test_chunks_from_one_byte_to_the_largest_bucket_are_accepted():
    for chunk in (2**-20, 0.004, 64, 65536):
        CheckpointEngineConfig(backend="gloo_sharded",
                               engine_kwargs={"gloo_sharded": {"chunk_megabytes": chunk}})
