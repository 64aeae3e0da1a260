"""weightsync's commands beside a Ray cluster that a user runs on the machine (``ray start
--head``): without ``RAY_ADDRESS`` or ``--address`` they start a private instance of their own;
with either they connect to that cluster. Each command runs in a process of its own.

A command here is ``weightsync bench`` at its smallest (1 MiB in one tensor, one bucket, one
receiver, one timed round): it starts actors on the cluster it reached and syncs through
them, which is what the cases need of it; a larger one measures nothing more of them."""

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightsync_core.orchestration.local_ray import CONNECT_SECONDS
from weightsync_core.testing import user_ray_cluster

BIN = Path(sys.executable).parent
AFTER_COMMAND = ("import sys, ray; from weightsync_core.cli import main; status = "
                 "main(sys.argv[1:]); print(ray.get_runtime_context().gcs_address); "
                 "sys.exit(status)")
"""Runs ``weightsync ARGS`` in this process, then prints the GCS address of the cluster the
command reached (the head reports its node's address, whichever address it was reached by:
compare ports)."""
BENCH_ARGS = ["bench", "gloo", "--size-mb", "1", "--tensors", "1", "--bucket-mb", "1",
              "--repeats", "1", "--receivers", "1"]
BENCH_REACHING = [sys.executable, "-c", AFTER_COMMAND, *BENCH_ARGS]
"""``weightsync bench``, then the GCS address of the cluster it ran on (one process: the
command itself says which cluster it reached)."""


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


@pytest.fixture(scope="module")
def user_cluster() -> Iterator[str]:
    """A one-CPU ``ray start --head`` on loopback; its GCS address."""
    with user_ray_cluster(num_cpus=1) as address:
        yield address


def _run(args: list[str], ray_address: str | None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def test_without_ray_address_a_command_starts_its_own_ray_beside_the_users(user_cluster):
    # the command runs its benchmark on the private instance it started, not the user's
    bench = _run(BENCH_REACHING, None)
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert _port(bench.stdout.split()[-1]) != _port(user_cluster)


def test_with_ray_address_a_command_connects_to_the_users_cluster(user_cluster):
    bench = _run(BENCH_REACHING, user_cluster)
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert _port(bench.stdout.split()[-1]) == _port(user_cluster)


def test_with_address_a_command_connects_to_the_users_cluster(user_cluster):
    bench = _run([*BENCH_REACHING, "--address", user_cluster], None)
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert _port(bench.stdout.split()[-1]) == _port(user_cluster)


def test_plan_measure_without_an_address_does_not_join_the_users_cluster(user_cluster):
    # a private instance is one node: no NIC to probe, said in one line
    plan = _run([sys.executable, "-c", AFTER_COMMAND, "plan", "--measure", "--model-gb", "1"],
                None)
    assert plan.returncode == 2, plan.stderr[-2000:]
    assert "needs a Ray cluster of at least two nodes" in plan.stderr
    assert _port(plan.stdout.split()[-1]) != _port(user_cluster)


@pytest.mark.parametrize("command", [BENCH_ARGS, ["compare", "gloo", "--size-mb", "4"]])
def test_an_unreachable_address_fails_in_seconds_with_one_line(command):
    with socket.socket() as held:  # bound, not listening: connections are refused
        held.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{held.getsockname()[1]}"
        start = time.monotonic()
        result = _run([str(BIN / "weightsync"), *command, "--address", closed], None)
        seconds = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-2000:]
    assert seconds < CONNECT_SECONDS + 20, seconds  # interpreter and imports included
    assert result.stderr.strip().splitlines() == [
        f"weightsync {command[0]}: no Ray cluster answers at {closed}: Connection refused "
        f"(waited at most {CONNECT_SECONDS:.0f} s)"
    ]
