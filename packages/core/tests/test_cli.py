"""The ``weightsync`` command line."""

import json
from importlib.metadata import PackageNotFoundError, distribution

import pytest

from weightsync_core.api.registry import KNOWN_BACKENDS
from weightsync_core.cli import main


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
