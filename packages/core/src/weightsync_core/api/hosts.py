"""Where this process's weight-sync listeners bind and peers reach it: one configured address
of this machine (``WEIGHTSYNC_HOST``, the engine's ``host`` option, or the Ray node's IP
address), never a wildcard."""

from __future__ import annotations

import errno
import os
import socket
import sys

__all__ = ["HOST_ENV", "check_bind_host", "default_host"]

HOST_ENV = "WEIGHTSYNC_HOST"


def default_host() -> str:
    """The address other processes use to reach this one.

    ``WEIGHTSYNC_HOST`` wins; inside Ray, the node's IP address; else ``127.0.0.1``.
    """
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    ray = sys.modules.get("ray")  # asked only where Ray runs: this layer never imports it
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def check_bind_host(host: str, setting: str | None = None) -> str:
    """``host``, if a weight-sync listener of this process can bind it: one address (never a
    wildcard such as ``0.0.0.0``) that belongs to this machine, checked by binding a
    throwaway socket to ``(host, 0)``. Call it in the process that will bind ``host`` (where
    the engine is built, where a listener is created), never on a driver that only checks a
    configuration: an address of a worker's machine is not one of the driver's.

    Args:
        host: the address to bind.
        setting: where ``host`` came from, for the error (e.g. ``"backend 'gloo': option
            'host' (engine_kwargs['gloo']['host'])"``); default: the engine's ``host``
            option or ``WEIGHTSYNC_HOST``.

    Raises:
        ValueError: naming the setting, the value, what is accepted and how to fix it.
    """
    given = setting or f"the weight-sync host (the engine's 'host' option, or {HOST_ENV})"
    fix = (
        f"set the engine's host option (engine_kwargs[<backend>]['host']) or {HOST_ENV} to "
        "this process's address on the cluster network, or leave both unset to use the Ray "
        "node's IP address"
    )
    if host in ("0.0.0.0", "::", "*", ""):
        raise ValueError(
            f"{given}: a weight-sync listener binds to one address of this machine, not "
            f"{host!r} (a wildcard: every interface); {fix}"
        )
    address = host.strip("[]")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError as exc:
        reason = ("no network interface of this machine holds that address (EADDRNOTAVAIL)"
                  if exc.errno == errno.EADDRNOTAVAIL else f"{type(exc).__name__}: {exc}")
        ray = sys.modules.get("ray")
        node = (f", or this Ray node's {ray.util.get_node_ip_address()}"
                if ray is not None and ray.is_initialized() else "")
        raise ValueError(
            f"{given} is {host!r}, which this machine ({socket.gethostname()}) cannot bind: "
            f"{reason}. Accepted: an address of one of this machine's network interfaces "
            f"(e.g. 127.0.0.1{node}); {fix}"
        ) from exc
    return host
