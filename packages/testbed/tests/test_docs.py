"""The engine configs of the testbed's docs page and README are accepted by the backends
they name."""

from pathlib import Path

from weightsync_core.testing.docs import check_documented_options


def test_documented_engine_options_are_options():
    readme = Path(__file__).parents[1] / "README.md"
    page = Path(__file__).parents[3] / "docs" / "testbed.md"  # the docs site's
    for document in (page, readme):
        assert [where.split()[-1] for where in check_documented_options(document)] == ["nixl"]


def test_core_command_runs_the_testbed_bench_through_its_entry_point(capsys):
    import pytest

    from weightsync_core.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["bench", "--testbed", "--help"])
    assert exited.value.code == 0
    assert "--size-mb" in capsys.readouterr().out
