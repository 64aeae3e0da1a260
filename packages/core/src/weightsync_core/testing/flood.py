"""A flooding outsider, for security tests: a separate process, holding no key, that throws
junk at every port an engine listens on, as fast as it can, for as long as a sync runs.

Run it as ``python -m weightsync_core.testing.flood HOST PORTS SECONDS``. Per port it keeps
:data:`CONNECTIONS` senders of each kind busy: ZeroMQ frames of 60 MiB (a ZeroMQ inbox that
reads a frame whole before checking it pays 60 MiB for each), small ZeroMQ frames in a tight
loop, and raw TCP streams of junk (for listeners that speak something else: a rendezvous
store, gloo's pairs, UCX, Mooncake). It runs at the lowest CPU priority: on a test machine
it shares the cores with the processes it attacks, which an attacker on another host would
not; what it costs them is what they do with its junk. It prints ``ready`` once every sender
runs, and a JSON report (what it sent) when it is done or gets SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time

__all__ = ["CONNECTIONS", "flood"]

CONNECTIONS = 2
"""Senders of each kind per port."""
_LARGE_FRAME = os.urandom(1 << 20) * 60
_SMALL_FRAME = os.urandom(64)
_RAW_CHUNK = os.urandom(1 << 20)
_STOP_SECONDS = 5.0
"""How long the senders together get to stop before the report is printed (each joined
for 5 s in turn, 48 senders of 8 ports outlasted a test's 60 s wait on a loaded CI
machine)."""


def _zmq_sender(context, endpoint: str, frame: bytes, stop: threading.Event,
                sent: list[int]) -> None:
    import zmq

    while not stop.is_set():
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDTIMEO, 100)
        push.setsockopt(zmq.SNDHWM, 4)
        push.connect(endpoint)
        try:
            for _ in range(1000 if len(frame) < 4096 else 4):
                if stop.is_set():
                    break
                try:
                    push.send(frame, copy=False)
                    sent[0] += len(frame)
                except zmq.Again:
                    break
        finally:
            push.close(linger=0)


def _raw_sender(host: str, port: int, stop: threading.Event, sent: list[int]) -> None:
    while not stop.is_set():
        try:
            with socket.create_connection((host, port), timeout=0.5) as connection:
                connection.settimeout(0.5)
                for _ in range(64):
                    if stop.is_set():
                        break
                    connection.sendall(_RAW_CHUNK)
                    sent[0] += len(_RAW_CHUNK)
        except OSError:
            time.sleep(0.01)


def flood(host: str, ports: list[int], seconds: float, stop: threading.Event) -> dict[str, int]:
    """Flood every port of ``host`` for ``seconds`` (or until ``stop`` is set); returns the
    bytes sent by kind."""
    import zmq

    context = zmq.Context()
    sent = {"large": [0], "small": [0], "raw": [0]}
    threads = []
    for port in ports:
        endpoint = f"tcp://{host}:{port}"
        for _ in range(CONNECTIONS):
            threads += [
                threading.Thread(target=_zmq_sender, daemon=True,
                                 args=(context, endpoint, _LARGE_FRAME, stop, sent["large"])),
                threading.Thread(target=_zmq_sender, daemon=True,
                                 args=(context, endpoint, _SMALL_FRAME, stop, sent["small"])),
                threading.Thread(target=_raw_sender, daemon=True,
                                 args=(host, port, stop, sent["raw"])),
            ]
    for thread in threads:
        thread.start()
    print("ready", flush=True)
    stop.wait(seconds)
    stop.set()
    deadline = time.monotonic() + _STOP_SECONDS  # one bound for all: at nice 19 on a loaded
    for thread in threads:  # machine a sender may take long to see the stop
        thread.join(max(0.0, deadline - time.monotonic()))
    return {kind: count[0] for kind, count in sent.items()}


if __name__ == "__main__":
    os.nice(19)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    host, ports, seconds = sys.argv[1:4]
    report = flood(host, [int(port) for port in ports.split(",") if port], float(seconds),
                   stopping)
    print(json.dumps(report), flush=True)
    os._exit(0)  # senders stuck in a connect must not hold the process
