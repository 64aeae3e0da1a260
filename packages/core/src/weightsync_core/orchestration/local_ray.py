"""Starting a local, single-machine Ray instance for tests, benchmarks and the trainer CLI."""

from __future__ import annotations

import logging
import os
import socket

import ray
from ray._private import ray_constants

from weightsync_core.api.hosts import HOST_ENV

__all__ = ["CONNECT_SECONDS", "ensure_ray"]

_UV_HOOK_ENV = "RAY_ENABLE_UV_RUN_RUNTIME_ENV"
_ADDRESS_ENV = "RAY_ADDRESS"
"""The running cluster to connect to (Ray's own variable)."""
CONNECT_SECONDS = 10.0
"""How long :func:`ensure_ray` waits for a cluster's ``HOST:PORT`` to accept a TCP connection
before it gives up (Ray itself would retry an unreachable address for many minutes)."""


def _check_reachable(address: str) -> None:
    """Raise :class:`ConnectionError` within :data:`CONNECT_SECONDS` unless something
    accepts TCP connections at ``address`` (``HOST:PORT``, ``[IPv6]:PORT``); other forms
    (``auto``, ``ray://...``) are left to Ray."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise ConnectionError(
            f"no Ray cluster answers at {address}: {reason} (waited at most "
            f"{CONNECT_SECONDS:.0f} s)") from exc


def ensure_ray(num_cpus: int = 2, env_vars: dict[str, str] | None = None,
               address: str | None = None) -> None:
    """Start Ray for this process, or connect to the cluster the user asks for (once per
    process; no-op if Ray is up).

    With ``address`` (default: the ``RAY_ADDRESS`` environment variable, as Ray reads it), it
    connects to that running cluster (``num_cpus`` is the cluster's own then), and workers
    listen on their node's address. Otherwise it starts a private, local instance on loopback
    whose workers get ``WEIGHTSYNC_HOST=127.0.0.1``, so every transfer stays on this machine;
    it never joins another Ray cluster running on the machine (a ``ray start --head``,
    another test run's), which would also refuse ``num_cpus``.

    Workers get ``env_vars`` too. Ray's uv run-time hook is disabled so workers start from the
    current venv.

    Raises:
        ConnectionError: nothing accepts a TCP connection at a ``HOST:PORT`` address within
            :data:`CONNECT_SECONDS` (refused at once, or an unreachable host), or Ray finds
            no cluster for ``auto``. An address that accepts TCP but is not a Ray cluster
            is left to Ray's own retries.
    """
    if ray.is_initialized():
        return
    if os.environ.setdefault(_UV_HOOK_ENV, "0") == "0":
        # Ray reads this at import time; the suite may be imported after ray already was.
        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    address = address or os.environ.get(_ADDRESS_ENV) or "local"
    worker_env = {_UV_HOOK_ENV: "0", **(env_vars or {})}
    if address != "local":
        _check_reachable(address)
        ray.init(address=address, runtime_env={"env_vars": worker_env},
                 logging_level=logging.WARNING)
        return
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {HOST_ENV: "127.0.0.1", **worker_env}},
        logging_level=logging.WARNING,
    )
