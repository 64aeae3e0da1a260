"""A testbed interrupted by Ctrl-C, then SIGTERM while it unwinds, leaves nothing behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from weightsync_testbed.cluster import kill_ray_processes
from weightsync_testbed.network import leftovers

PREFIX = "wsts"
_SCRIPT = f"""
import time
from weightsync_testbed import Testbed
with Testbed(hosts=["t0"], prefix="{PREFIX}"):
    print("up", flush=True)
    time.sleep(600)
"""


def test_ctrl_c_then_sigterm_tear_everything_down(namespaces_available) -> None:
    process = subprocess.Popen([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline().strip() == "up"
        assert leftovers(PREFIX)["namespaces"] == [f"{PREFIX}-t0"]
        process.send_signal(signal.SIGINT)
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)  # impatient: must not cut the teardown short
        process.wait(timeout=120)
    finally:
        process.kill()
    assert leftovers(PREFIX) == {"namespaces": [], "links": [], "etc": []}
    assert kill_ray_processes(PREFIX) == []
