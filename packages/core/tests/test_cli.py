"""The ``weightsync`` command line."""

import argparse
import json
import re
from importlib.metadata import PackageNotFoundError, distribution

import pytest

from weightsync_core import cli
from weightsync_core.api.registry import KNOWN_BACKENDS
from weightsync_core.cli import build_parser, main


def _missing_backend() -> str:
    """A first-party backend whose distribution is not installed in this environment."""
    for name, known in KNOWN_BACKENDS.items():
        try:
            distribution(known.distribution)
        except PackageNotFoundError:
            return name
    pytest.skip("every first-party backend is installed in this environment")


def test_backends_lists_every_backend_with_distribution_and_state(capsys):
    missing = _missing_backend()
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "loaded" in lines["gloo"]
    assert "not installed" in lines[missing]
    assert f"pip install {KNOWN_BACKENDS[missing].distribution}" in lines[missing]
    assert "weightsync-kimi" in lines["kimi_ckpt_engine"]


def test_backends_json(capsys):
    missing = _missing_backend()
    assert main(["backends", "--json", "--no-probe"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[missing]["state"] == "not installed"
    assert rows[missing]["distribution"] == KNOWN_BACKENDS[missing].distribution


def test_benchmarks_and_harness_do_not_need_pytest():
    """`weightsync bench` must work where only weightsync-core is installed."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['pytest'] = None\n"
        "import weightsync_core.bench.gloo, weightsync_core.bench.ring\n"
        "import weightsync_core.bench.compare, weightsync_core.testing as t\n"
        "assert t.SyncHarness and t.make_weights\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bench_on_the_testbed_without_the_testbed_says_what_to_install(capsys):
    from importlib.metadata import entry_points

    if entry_points(group="weightsync.bench", name="testbed"):
        pytest.skip("weightsync-testbed is installed in this environment")
    assert main(["bench", "--testbed", "gloo"]) == 2
    assert "pip install weightsync-testbed" in capsys.readouterr().err


def _every_parser(parser: argparse.ArgumentParser):
    """``parser`` and every subcommand's parser under it, with the command line of each."""
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases: once each
                yield from _every_parser(sub)


# reStructuredText that argparse would print as it is: ``literals``, :roles:`...`, `refs`_
_MARKUP = re.compile(r"``|:[a-z]+(:[a-z]+)?:`|`[^`]+`_|`")


def test_every_help_is_plain_text():
    """argparse prints descriptions and help as they are: no reStructuredText in them,
    and no pointer to the old core README (the docs are a site now)."""
    helps = dict((prog, sub.format_help()) for prog, sub in _every_parser(build_parser()))
    assert {"weightsync", "weightsync bench", "weightsync plan"} <= set(helps)
    for prog, text in helps.items():
        found = _MARKUP.search(text)
        assert found is None, f"{prog} --help shows markup {found.group()!r}:\n{text}"
        assert "README" not in text, f"{prog} --help points to a README:\n{text}"


def test_bench_backend_is_optional_in_the_usage_and_required_without_testbed(capsys):
    usage = build_parser().parse_args(["bench", "gloo"])  # still parses with a backend
    assert usage.backend == "gloo"
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--help"])
    assert exited.value.code == 0
    assert "[backend]" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--size-mb", "8"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "a backend is required" in err
    for choice in ("gloo", "nixl", "mooncake", "--testbed"):
        assert choice in err


def test_bench_testbed_hands_its_backends_to_the_testbed(monkeypatch):
    """`--testbed` measures any number of backends: they go to the testbed's benchmark."""
    handed = []
    monkeypatch.setattr(cli, "_bench_from_entry_point",
                        lambda name, argv: handed.append((name, argv)) or 0)
    assert main(["bench", "--testbed", "gloo", "nixl", "--size-mb", "8"]) == 0
    assert main(["bench", "--testbed"]) == 0
    assert handed == [("testbed", ["gloo", "nixl", "--size-mb", "8"]), ("testbed", [])]


_PLAN = ["plan", "--model-gb", "1"]
_NUMERIC_FLAGS = [
    *([*_PLAN, flag] for flag in (
        "--bucket-mb", "--pipeline-depth", "--actor-hosts", "--actor-ranks-per-host",
        "--replicas", "--workers-per-replica", "--rollout-workers-per-host", "--nics-per-host",
        "--nic-gbit", "--intra-gbyte")),
    *(["bench", "gloo", flag] for flag in (
        "--size-mb", "--receivers", "--bucket-mb", "--tensors", "--repeats",
        "--learning-rate")),
    *(["compare", "gloo", flag] for flag in (
        "--actors", "--replicas", "--size-mb", "--bucket-mb", "--tensors", "--repeats")),
]


@pytest.mark.parametrize("value", ["0", "-1"])
@pytest.mark.parametrize("command", _NUMERIC_FLAGS, ids=" ".join)
def test_numeric_flags_refuse_zero_and_negatives_naming_the_flag(command, value, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*command, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {command[-1]}: " in err
    assert f"got '{value}'" in err


@pytest.mark.parametrize(("flag", "value"), [
    ("--model-gb", "-1"), ("--model-gb", "0"), ("--model-gb", "nan"),
    ("--largest-tensor-mb", "-1"), ("--nic-latency-us", "-1"), ("--intra-latency-us", "-1"),
    ("--replicated-fraction", "-0.5"), ("--replicated-fraction", "2"),
    ("--nic-gbit", "inf"), ("--replicas", "1.5"),
])
def test_plan_errors_name_the_flag_and_the_value_as_given(flag, value, capsys):
    """Not the planner's fields: `--model-gb -1` once said "model_bytes ... got -1000000000"."""
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model-gb", "1", flag, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err
    assert f"got '{value}'" in err
    assert "model_bytes" not in err and "_" not in err.rpartition("error:")[2]


def test_plan_cross_checks_name_the_flags(capsys):
    assert main(["plan", "--model-gb", "1", "--largest-tensor-mb", "5000"]) == 2
    err = capsys.readouterr().err
    assert "--largest-tensor-mb 5000" in err and "--model-gb 1" in err
    assert "largest_tensor_bytes" not in err
    assert main(["plan", "--model-gb", "1e-12", "--json"]) == 0  # under a byte: one byte
    capsys.readouterr()


def test_json_options_refuse_what_is_not_a_json_object(capsys):
    for command in (["bench", "gloo", "--engine-kwargs", "[1]"],
                    ["compare", "gloo", "--kwargs", "gloo={"],
                    ["compare", "gloo", "--kwargs", "gloo"],
                    ["compare", "gloo", "--replicas", "2,x"]):
        with pytest.raises(SystemExit) as exited:
            main(command)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {command[2]}: " in err and repr(command[3]) in err
