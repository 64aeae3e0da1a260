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
