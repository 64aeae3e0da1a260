"""weightsync's commands beside a Ray cluster that a user runs on the machine (``ray start
--head``): without ``RAY_ADDRESS`` they start a private instance of their own; with it they
connect to that cluster. Each command runs in a process of its own."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
WHICH_CLUSTER = ("import ray; from weightsync_core import ensure_ray; ensure_ray(); "
                 "print(ray.get_runtime_context().gcs_address)")
"""Prints the GCS address of the cluster ``ensure_ray`` reached (the head reports its node's
address, whichever address it was reached by: compare ports)."""
BENCH = [str(BIN / "weightsync"), "bench", "gloo", "--size-mb", "4", "--tensors", "4",
         "--repeats", "1", "--receivers", "1"]


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def user_cluster() -> Iterator[str]:
    """A one-CPU ``ray start --head --block`` in a session of its own; its GCS address on
    loopback. Killed with its whole process group (``ray stop`` would stop every Ray on the
    machine)."""
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="rayhead-")  # short: Ray's socket paths must fit
    env = {**os.environ, "RAY_ADDRESS": ""}
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
         "--node-ip-address=127.0.0.1", "--include-dashboard=false",
         f"--temp-dir={temp_dir}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([str(BIN / "ray"), "status", f"--address={address}"], env=env,
                             capture_output=True).returncode != 0:
            assert head.poll() is None, "ray start --head exited"
            assert time.monotonic() < deadline, "ray start --head did not come up"
            time.sleep(1)
        yield address
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(30)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _run(args: list[str], ray_address: str | None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def test_without_ray_address_a_command_starts_its_own_ray_beside_the_users(user_cluster):
    which = _run([sys.executable, "-c", WHICH_CLUSTER], None)
    assert which.returncode == 0, which.stderr[-2000:]
    assert _port(which.stdout.split()[-1]) != _port(user_cluster)

    bench = _run(BENCH, None)
    assert bench.returncode == 0, bench.stderr[-2000:]


def test_with_ray_address_a_command_connects_to_the_users_cluster(user_cluster):
    which = _run([sys.executable, "-c", WHICH_CLUSTER], user_cluster)
    assert which.returncode == 0, which.stderr[-2000:]
    assert _port(which.stdout.split()[-1]) == _port(user_cluster)

    bench = _run(BENCH, user_cluster)
    assert bench.returncode == 0, bench.stderr[-2000:]
