"""A Ray cluster over a :class:`~weightsync_testbed.network.Network`: the head in the root
namespace on the bridge address, one Ray node per emulated host inside its namespace.

Each node offers the custom resource ``host:<name>`` (1000 units) so that actors can be
placed on it (:mod:`weightsync_testbed.placement`). The cluster uses token authentication
(a fresh token per cluster) and its own temporary directory, so it neither joins nor
disturbs another Ray instance on the machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from weightsync_testbed.network import Network

__all__ = ["HOST_RESOURCE_UNITS", "RayCluster", "host_resource", "kill_ray_processes"]

HOST_RESOURCE_UNITS = 1000
"""Units of ``host:<name>`` each node offers; an actor placed on a host takes one."""

_TEMP_ROOT = Path("/tmp/weightsync-testbed")
_MARKER = "WEIGHTSYNC_TESTBED_CLUSTER"
"""Environment variable every process of a testbed cluster carries (how leftovers are found)."""


def host_resource(host: str) -> str:
    """The custom resource naming ``host``."""
    return f"host:{host}"


@dataclass
class _Started:
    host: str | None
    process: subprocess.Popen[bytes]


class RayCluster:
    """Ray head plus one node per host of ``network``.

    Args:
        network: the (created) network.
        cpus_per_host: logical CPUs each node advertises.
        object_store_bytes: object store size of every node.
        startup_timeout: seconds to wait for every node to join.
    """

    def __init__(
        self, network: Network, cpus_per_host: int = 2, object_store_bytes: int = 1 << 30,
        startup_timeout: float = 120.0,
    ) -> None:
        self.network = network
        self.cpus_per_host = cpus_per_host
        self.object_store_bytes = object_store_bytes
        self.startup_timeout = startup_timeout
        self.token = secrets.token_hex(32)
        # a GCS port of its own per testbed (the subnet is unique per prefix): several can run
        self.port = 6390 + network.subnet
        self.address = f"{network.gateway}:{self.port}"
        self.temp_dir = _TEMP_ROOT / network.prefix
        self._started: list[_Started] = []
        self._log_dir = self.temp_dir / "launch-logs"

    @property
    def driver_env(self) -> dict[str, str]:
        """Environment a driver needs to join the cluster (its token)."""
        return {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            # a host whose cable is out for a fault test is not declared dead for a minute
            "RAY_health_check_period_ms": "3000",
            "RAY_health_check_failure_threshold": "20",
        }

    @property
    def env(self) -> dict[str, str]:
        """Environment of every process of the cluster: the driver's, plus the mark by which
        :func:`kill_ray_processes` finds leftovers."""
        return {**self.driver_env, _MARKER: self.network.prefix}

    def _ray(self) -> str:
        found = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
        if found is None:
            raise RuntimeError("the `ray` command is not installed beside this Python")
        return found

    def _launch(self, host: str | None, args: list[str]) -> None:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self._log(host), "wb")  # noqa: SIM115 - handed to the child
        prefix = self.network.exec_prefix(host) if host else []
        process = subprocess.Popen(
            [*prefix, self._ray(), "start", "--block", "--disable-usage-stats", *args],
            env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        self._started.append(_Started(host, process))
        self._wait_until_started(self._started[-1])

    def start(self) -> None:
        """Start the head, then each node in turn (raylets started at once on a small
        machine time out registering); return once all have joined."""
        if self.temp_dir.exists():
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        self._launch(None, [
            "--head", f"--node-ip-address={self.network.gateway}", f"--port={self.port}",
            "--num-cpus=0", "--include-dashboard=false", f"--temp-dir={self.temp_dir}",
            f"--object-store-memory={256 << 20}",
        ])
        for name, host in self.network.hosts.items():
            self._launch(name, [
                f"--address={self.address}", f"--node-ip-address={host.address}",
                f"--num-cpus={self.cpus_per_host}",
                f"--resources={{\"{host_resource(name)}\": {HOST_RESOURCE_UNITS}}}",
                f"--object-store-memory={self.object_store_bytes}",
            ])

    def _log(self, host: str | None) -> Path:
        return self._log_dir / f"{host or 'head'}.log"

    def _wait_until_started(self, started: _Started) -> None:
        """Wait for ``ray start --block`` to say the node runs (it then blocks)."""
        deadline = time.monotonic() + self.startup_timeout
        where = started.host or "the head"
        log = ""
        while time.monotonic() < deadline:
            log = self._log(started.host).read_text(errors="replace")
            if "Ray runtime started" in log:
                return
            if started.process.poll() is not None:
                raise RuntimeError(f"the Ray node of {where} exited "
                                   f"({started.process.returncode}):\n{log[-2000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"the Ray node of {where} did not start within "
                           f"{self.startup_timeout:.0f}s:\n{log[-2000:]}")

    def stop(self) -> None:
        """Kill every process of the cluster at once (a throwaway cluster needs no orderly
        shutdown; that takes a minute on a small machine) and remove its files
        (idempotent)."""
        for started in self._started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(started.process.pid, signal.SIGKILL)
        kill_ray_processes(self.network.prefix)
        for started in self._started:
            started.process.wait(timeout=10)
        self._started.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _cluster_processes(prefix: str | None) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid"]):
        if process.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            mark = process.environ().get(_MARKER)
            if mark is not None and prefix in (None, mark):
                found.append(process)
    return found


def kill_ray_processes(prefix: str | None = None, timeout: float = 10.0) -> list[int]:
    """Kill every process of the testbed cluster ``prefix`` (``None``: of any testbed),
    found by the mark in its environment; returns their pids."""
    processes = _cluster_processes(prefix)
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(processes, timeout=timeout)
    return [process.pid for process in processes]
