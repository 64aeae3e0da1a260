"""The README's engine configs are accepted by the backends they name."""

from pathlib import Path

from weightsync_core.testing.docs import check_documented_options


def test_documented_engine_options_are_options():
    readme = Path(__file__).parents[1] / "README.md"
    assert [where.split()[-1] for where in check_documented_options(readme)] == ["nixl"]


def test_core_command_runs_the_testbed_bench_through_its_entry_point(capsys):
    import pytest

    from weightsync_core.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["bench", "--testbed", "--help"])
    assert exited.value.code == 0
    assert "--size-mb" in capsys.readouterr().out
