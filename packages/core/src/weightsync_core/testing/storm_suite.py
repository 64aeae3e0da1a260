"""Conformance case of a connection storm: an outsider holding no key opens and closes
thousands of TCP connections (tens of thousands in the long profile) at every port the
processes of a sync listen on, holds hundreds more open, and churns them through a sync,
as a small C program does (:mod:`weightsync_core.testing.churn`). No process may die,
grow past the stated bounds or serve anything but the sender's bytes. Mix into the
backend's conformance class (one deployment serves both)::

    class TestNixlConformance(CheckpointEngineConformanceTests, ConnectionStormTests):
        backend = "nixl"
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Sequence
from typing import ClassVar

import ray

from weightsync_core.testing.churn import build_churner
from weightsync_core.testing.harness import SyncHarness
from weightsync_core.testing.profile import by_profile
from weightsync_core.testing.suite import _ConformanceBase

__all__ = ["ConnectionStormTests"]

_SEED = 90
DEFAULT_STORM_SHARE = 25
"""The default profile opens and closes ``storm_connections // 25`` connections at each port
(1,000): a descriptor kept per connection would grow a process by 1,000 (bound 64), memory
kept per connection shows from 64 KiB (from 2.6 KiB with the long profile's 25,000)."""


class ConnectionStormTests(_ConformanceBase):
    """What a connection storm may cost each process of a sync (:attr:`storm_bounds`), and
    that every sync through and after it is bit-exact."""

    storm_connections: ClassVar[int] = 25_000
    """Connections opened and closed at each listening port between syncs, in the long
    profile; the default one opens a 25th of them (:data:`DEFAULT_STORM_SHARE`)."""
    storm_held: ClassVar[int] = 500
    """Connections held open at each listening port through a sync."""
    storm_bounds: ClassVar[dict[str, int]] = {"fds": 64, "rss": 64 << 20}
    """How many file descriptors and bytes of resident memory each process may gain from a
    storm (after it ends and the next sync ran)."""
    storm_syncs: ClassVar[int] = 2
    """Syncs run through the churn."""
    storm_time_bound: ClassVar[tuple[float, float]] = (3.0, 5.0)
    """How long a sync through the churn may take: at most ``factor`` times the slower of
    two calm syncs plus ``seconds``."""

    def test_connection_storm_at_every_port_kills_no_process(self, harness: SyncHarness
                                                             ) -> None:
        """:attr:`storm_connections` (a 25th in the default profile) opened and closed at
        every port the sync's processes listen on between syncs, 500 held at each through
        the next :attr:`storm_syncs` syncs while a low-priority churner opens and closes
        more at those ports and at every port those processes start listening on during
        the syncs
        (rendezvous stores, transport listeners, from the moment they listen): every sync
        bit-exact and within :attr:`storm_time_bound`, no process died, and none keeps more
        than :attr:`storm_bounds` once the storm is over."""
        manager = harness.manager()  # staged where the backend stages (the default)
        processes = harness.workers()
        self.timed_sync(harness, manager, _SEED)  # every engine listens now
        calm = max(self.timed_sync(harness, manager, _SEED + step) for step in (1, 2))
        before = ray.get([process.resources.remote() for process in processes])
        ports = sorted({port for ports in harness.engine_ports().values() for port in ports})
        churner = str(build_churner())
        connections = by_profile(default=self.storm_connections // DEFAULT_STORM_SHARE,
                                 long=self.storm_connections)
        between = _run(churner, ports, "close", connections)
        held = _start([churner, "127.0.0.1", _joined(ports), "hold", str(self.storm_held)])
        # the ports that start listening in the sync's processes only: another package's
        # tests may run on this host (scripts/test-packages runs two at once)
        pids = ",".join(str(pid) for pid in harness.engine_ports())
        churning = _start(["nice", "-n", "19", churner, "127.0.0.1", _joined(ports), "watch",
                           "600"], env={**os.environ, "CHURN_PIDS": pids})
        try:
            for churner_process in (held, churning):
                _await_ready(churner_process)
            seconds = [self.timed_sync(harness, manager, _SEED + 3 + step)
                       for step in range(self.storm_syncs)]
        finally:
            during = [_stop(process) for process in (held, churning)]
        self.timed_sync(harness, manager, _SEED + 3 + self.storm_syncs)
        after = ray.get([process.resources.remote() for process in processes])
        growth = {key: max(b[key] - a[key] for a, b in zip(before, after, strict=True))
                  for key in self.storm_bounds}
        took = ", ".join(f"{sync:.1f}" for sync in seconds)
        factor, extra = self.storm_time_bound
        print(f"\n[{self.backend}] storm at {len(ports)} ports: between syncs {between}; "
              f"held {during[0]}; churned through {len(seconds)} syncs ({took} s, calm "
              f"{calm:.1f} s) {during[1]}; worst growth per process {growth}")
        assert between["connections"] + between["refused"] >= connections * len(ports), between
        assert max(seconds) <= factor * calm + extra, (
            f"a sync through the churn took {max(seconds):.1f} s (calm {calm:.1f} s)")
        for key, bound in self.storm_bounds.items():
            assert growth[key] <= bound, f"{key} grew by {growth[key]} after the storm: {growth}"



def _joined(ports: Sequence[int]) -> str:
    """The churner's port list."""
    if not ports:
        return "0"  # nothing listens: the churner meets refusals only
    return ",".join(map(str, ports))


def _run(churner: str, ports: Sequence[int], mode: str, amount: int) -> dict[str, float]:
    """Run the churner to its end; its report."""
    done = subprocess.run([churner, "127.0.0.1", _joined(ports), mode, str(amount)],
                          capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _start(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A churner in a session of its own (its children with it: see :func:`_stop`)."""
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)


def _await_ready(process: subprocess.Popen[str]) -> None:
    if process.stdout is None:  # stdout=PIPE makes it a pipe: None is a bug
        raise RuntimeError("the churner's stdout is not a pipe")
    line = process.stdout.readline().strip()
    if line != "ready":
        raise RuntimeError(f"the churner did not start: {line!r}")


def _stop(process: subprocess.Popen[str]) -> dict[str, float]:
    """Stop a churner (SIGTERM) and every process of its session; its report (empty where
    it did not end within 60 s, or printed none)."""
    process.terminate()
    try:
        output, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        output = ""
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    lines = output.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}
