"""One living testbed per prefix: a run killed before its teardown does not break the next
run of the same prefix, and a second living run waits, then names the first."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from weightsync_testbed import Testbed, TestbedBusyError
from weightsync_testbed.claim import PrefixClaim
from weightsync_testbed.cluster import kill_ray_processes
from weightsync_testbed.network import leftovers

KILLED = "wstk"
BUSY = "wstb"
_NOTHING: dict[str, list[str]] = {"namespaces": [], "links": [], "etc": []}

_RUN_UNTIL_KILLED = f"""
import time
from weightsync_testbed import Testbed
with Testbed(hosts=["t0"], prefix="{KILLED}", connect=False):
    print("up", flush=True)
    time.sleep(600)
"""

_HOLD_CLAIM = f"""
import time
from weightsync_testbed.claim import PrefixClaim
PrefixClaim("{BUSY}").acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_a_testbed_killed_before_its_teardown_does_not_break_the_next(
    namespaces_available,
) -> None:
    process = subprocess.Popen([sys.executable, "-c", _RUN_UNTIL_KILLED],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "up"
    finally:
        process.send_signal(signal.SIGKILL)  # no teardown at all
        process.wait(timeout=30)
    assert leftovers(KILLED)["links"], "the killed run should have left its network behind"

    with Testbed(hosts=["t0"], prefix=KILLED, connect=False, wait_seconds=5) as bed:
        assert leftovers(KILLED)["namespaces"] == [f"{KILLED}-t0"]
        assert bed.claim.held
    assert leftovers(KILLED) == _NOTHING
    assert kill_ray_processes(KILLED) == []


def test_a_second_living_testbed_of_one_prefix_waits_then_names_the_first(
    namespaces_available,
) -> None:
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_CLAIM], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TestbedBusyError, match=rf"'{BUSY}' is in use by pid {holder.pid}"):
            Testbed(hosts=["t0"], prefix=BUSY, wait_seconds=1).__enter__()
        assert leftovers(BUSY) == _NOTHING  # nothing of the living run's was touched
    finally:
        holder.kill()
        holder.wait(timeout=30)
    claim = PrefixClaim(BUSY, wait_seconds=0)
    claim.acquire()  # the kernel gave the dead holder's claim up
    claim.release()
