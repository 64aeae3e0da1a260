"""What a process holds (file descriptors, threads, memory, listening ports), for soak tests
that check a long run leaks nothing."""

from __future__ import annotations

import os

__all__ = ["process_resources"]


def process_resources() -> dict[str, object]:
    """This process's open file descriptors, threads, resident memory (bytes), established
    TCP connections and listening TCP addresses (``"ip:port"``). Needs ``psutil`` (in the
    ``testing`` extra)."""
    import psutil

    process = psutil.Process(os.getpid())
    connections = process.net_connections("tcp")
    return {
        "fds": process.num_fds(),
        "threads": process.num_threads(),
        "rss": process.memory_info().rss,
        "established": sum(c.status == psutil.CONN_ESTABLISHED for c in connections),
        "listening": sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in connections
                            if c.status == psutil.CONN_LISTEN),
    }
