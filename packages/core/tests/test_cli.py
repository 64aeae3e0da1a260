"""The ``weightsync`` command line."""

import json

from weightsync_core.cli import main


def test_backends_lists_every_backend_with_distribution_and_state(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "loaded" in lines["gloo"]
    assert "not installed" in lines["nixl"]
    assert "pip install weightsync-nixl" in lines["nixl"]
    assert "weightsync-kimi" in lines["kimi_ckpt_engine"]


def test_backends_json(capsys):
    assert main(["backends", "--json", "--no-probe"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows["mooncake"]["state"] == "not installed"
    assert rows["mooncake"]["distribution"] == "weightsync-mooncake"


def test_benchmark_and_harness_do_not_need_pytest():
    """`weightsync bench` must work where only weightsync-core is installed."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['pytest'] = None\n"
        "import weightsync_core.benchmark, weightsync_core.testing as t\n"
        "assert t.SyncHarness and t.make_weights\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
