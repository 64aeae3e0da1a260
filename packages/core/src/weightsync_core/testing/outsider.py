"""An outsider on the cluster network, for security tests: a separate process, holding no
session key, that throws what an attacker would at every port an engine listens on.

Run it as ``python -m weightsync_core.testing.outsider HOST PORTS MARKER SECONDS``; it prints
``ready`` once it has attacked every port, then ``round N`` after each further round, and a
JSON report when it is done (or when it gets SIGTERM). Every payload that reaches a decoder
able to run code creates the file ``MARKER``; the test asserts it never appears.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import TypedDict

__all__ = ["attack"]

_GUESSED_KEYS = [
    *(f"weightsync/arrived/{rank}" for rank in range(4)),
    *(f"weightsync/control/{rank}" for rank in range(4)),
    "weightsync/data/0",
]
"""Rendezvous keys as weightsync 0.2.0 named them (an outsider's best guess)."""


class _Payload:
    """Unpickling this creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _payloads(marker: str) -> list[bytes]:
    pickled = pickle.dumps({"kind": "credit", "sync": "x", "slot": 0, "x": _Payload(marker)})
    return [pickled, b"\x00" * 64 + pickled, os.urandom(256), b"\xff" * 40]


def _raw_tcp(host: str, port: int, data: bytes) -> None:
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(data)
    except OSError:
        pass


def _zmq_push(context, host: str, port: int, frames: list[bytes]) -> None:
    import zmq

    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDTIMEO, 200)
    try:
        push.connect(f"tcp://{host}:{port}")
        for frame in frames:
            try:
                push.send(frame)
            except zmq.Again:
                break
    finally:
        push.close(linger=0)


class _Probe(TypedDict, total=False):
    store: bool
    """The port spoke the TCPStore protocol."""
    keys_found: list[str]
    """Rendezvous keys it let the outsider read."""
    listed: list[str]
    """Keys it listed to the outsider."""


def _store_probe(host: str, port: int, written: set[str]) -> _Probe:
    """Join ``port`` as a TCPStore client; try to list and read rendezvous state (keys it
    did not write itself: ``written``) and to claim every rank. A port that is no store may
    never answer the client's handshake: given up after 2 s (a store on this host answers
    in milliseconds)."""
    result: _Probe = {}

    def probe() -> None:
        import torch.distributed as dist

        try:
            # public API, but torch.distributed re-exports it without ``__all__``/``as``
            store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
                host, port, is_master=False, timeout=datetime.timedelta(seconds=2),
                wait_for_workers=False,
            )
        except Exception:  # not a store
            return
        listed = [key for key in _quiet(store.list_keys) or [] if key not in written]
        found = [key for key in _GUESSED_KEYS
                 if key not in written and _quiet(store.check, [key])]
        for rank in range(4):  # claim every rank (a write may land: it costs nothing to try)
            written.add(f"weightsync/arrived/{rank}")
            _quiet(store.set, f"weightsync/arrived/{rank}", "1")
        result.update(store=True, keys_found=found, listed=listed)

    worker = threading.Thread(target=probe, daemon=True)
    worker.start()
    worker.join(3.0)
    return result.copy()


def _quiet(function, *args):
    try:
        return function(*args)
    except Exception:
        return None


def _attack_port(context, host: str, port: int, marker: str, written: set[str]) -> _Probe:
    """One round on ``port``: pickled and random payloads over ZMQ and raw TCP, then a
    TCPStore probe (see :func:`_store_probe`)."""
    payloads = _payloads(marker)
    _zmq_push(context, host, port, payloads)
    for payload in payloads:
        _raw_tcp(host, port, payload)
    return _store_probe(host, port, written)


def attack(
    host: str, ports: list[int], marker: str, seconds: float, stop: dict[str, bool]
) -> dict[str, object]:
    """Attack every port in rounds for ``seconds`` (or until ``stop["now"]``: the report
    follows at once, with what the round under way learned so far), the ports of a round at
    once (a port that is no store holds its probe for up to 3 s); returns what was learned:
    ``stores`` (ports that spoke the TCPStore protocol), ``listed`` (keys they listed) and
    ``keys_found`` (rendezvous keys the outsider could read)."""
    import zmq

    context = zmq.Context()
    rounds = 0
    stores: list[int] = []
    keys_found: list[str] = []
    listed: list[str] = []
    written: dict[int, set[str]] = {port: set() for port in ports}

    def learn(port: int, probe: _Probe) -> None:
        nonlocal keys_found
        if probe.get("store") and port not in stores:
            stores.append(port)
        keys_found += probe.get("keys_found", [])
        listed.extend(key for key in probe.get("listed", []) if key not in listed)

    deadline = time.monotonic() + seconds
    pool = ThreadPoolExecutor(max_workers=max(1, len(ports)))
    try:
        while not stop["now"] and time.monotonic() < deadline:
            pending = {pool.submit(_attack_port, context, host, port, marker, written[port]): port
                       for port in ports}
            while pending and not stop["now"]:
                done, _ = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
                for future in done:
                    learn(pending.pop(future), future.result())
            if pending:  # stopped mid-round
                break
            rounds += 1
            print("ready" if rounds == 1 else f"round {rounds}", flush=True)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # probes stuck in a handshake: left
        context.term()  # every ZeroMQ socket is closed within its 200 ms send timeout
    return {"rounds": rounds, "stores": stores, "keys_found": keys_found, "listed": listed}


if __name__ == "__main__":
    stopping = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(now=True))
    host, ports, marker, seconds = sys.argv[1:5]
    result = attack(host, [int(port) for port in ports.split(",") if port], marker,
                    float(seconds), stopping)
    print(json.dumps(result), flush=True)
    os._exit(0)  # probes still stuck in a handshake must not hold the process
