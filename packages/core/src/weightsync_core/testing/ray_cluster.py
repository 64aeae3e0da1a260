"""A Ray cluster of the user's own on this machine (``ray start --head``), for tests of what
weightsync's commands do beside it: start a private instance, or connect when asked."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["user_ray_cluster"]

_BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def user_ray_cluster(num_cpus: int = 1, start_seconds: float = 60.0) -> Iterator[str]:
    """A ``ray start --head --block`` on loopback, in a session of its own, with ``num_cpus``
    CPUs and no dashboard; yields its GCS address (``127.0.0.1:PORT``).

    It is started without ``RAY_ADDRESS`` and its own temp dir, and on leaving it is killed
    with its whole process group (``ray stop`` would stop every Ray on the machine).

    Raises:
        RuntimeError: it exits, or does not answer ``ray status`` within ``start_seconds``.
    """
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="rayhead-")  # short: Ray's socket paths must fit
    env = {**os.environ, "RAY_ADDRESS": ""}
    head = subprocess.Popen(
        [str(_BIN / "ray"), "start", "--head", "--block", f"--port={port}",
         f"--num-cpus={num_cpus}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
         f"--temp-dir={temp_dir}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_seconds
        while subprocess.run([str(_BIN / "ray"), "status", f"--address={address}"], env=env,
                             capture_output=True).returncode != 0:
            if head.poll() is not None:
                raise RuntimeError(f"ray start --head exited with {head.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ray start --head did not answer within {start_seconds} s")
            time.sleep(1)
        yield address
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(30)
        shutil.rmtree(temp_dir, ignore_errors=True)
