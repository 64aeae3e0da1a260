"""Starting a local, single-machine Ray instance for tests, benchmarks and the trainer CLI."""

from __future__ import annotations

import logging
import os

import ray
from ray._private import ray_constants

from weightsync_core.process_group import HOST_ENV

__all__ = ["ensure_ray"]

_UV_HOOK_ENV = "RAY_ENABLE_UV_RUN_RUNTIME_ENV"


def ensure_ray(num_cpus: int = 2, env_vars: dict[str, str] | None = None) -> None:
    """Start a private, local Ray instance on loopback (once per process; no-op if Ray is
    up). It never joins another Ray cluster running on the machine (a ``ray start --head``,
    another test run's), which would also refuse ``num_cpus``.

    Workers get ``WEIGHTSYNC_HOST=127.0.0.1`` so every transfer stays on this machine, plus
    ``env_vars``. Ray's uv run-time hook is disabled so workers start from the current venv.
    """
    if ray.is_initialized():
        return
    if os.environ.setdefault(_UV_HOOK_ENV, "0") == "0":
        # Ray reads this at import time; the suite may be imported after ray already was.
        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    worker_env = {HOST_ENV: "127.0.0.1", _UV_HOOK_ENV: "0", **(env_vars or {})}
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": worker_env},
        logging_level=logging.WARNING,
    )
