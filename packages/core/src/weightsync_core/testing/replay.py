"""A replaying outsider, for security tests: it holds no session key, but it has captured
every control frame the members of a sync sent (as an attacker who can read the network
would), and it sends them again, to where they went and elsewhere, at random moments of the
same sync.

:func:`tap_control_frames` runs inside a member process (the harness's actors call it): it
appends every frame the process's ZeroMQ sockets send, with the endpoint it went to, to a
file. Run the outsider as ``python -m weightsync_core.testing.replay TAP_DIR SECONDS SEED RATE
[KIND ...]``: it follows every ``*.tap`` file in ``TAP_DIR`` and replays each captured frame
with probability ``RATE`` (a rate over 1 replays it that many times on average), each time
after a random delay of up to half a second, to its destination or to another endpoint it
has seen. With ``KIND`` (``credit``, ``bucket``, ``hello``, ``final``:
the tags of the ring's messages, which travel unencrypted inside the sealed frame), only
frames of those kinds are replayed, and only to where they went: the targeted attack (a
replayed credit lets the upstream write into a slot its server may still read). It prints
``ready`` once it follows the files, and a JSON report (frames captured and sent) when it is
done or gets SIGTERM.
"""

from __future__ import annotations

import base64
import heapq
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

__all__ = ["replay", "tap_control_frames"]

_MAX_DELAY_SECONDS = 0.5


_tapped: dict[str, object] = {}
"""The original ``send`` of ZeroMQ's asyncio sockets while a tap is installed."""


def tap_control_frames(path: str | None) -> None:
    """From now on, append every frame any ZeroMQ socket of this process sends to ``path``
    (one ``endpoint<TAB>base64 frame`` line each; the endpoint is where the socket
    connects); ``None`` removes the tap."""
    import zmq
    import zmq.asyncio

    original = _tapped.pop("send", None)
    if original is not None:
        zmq.asyncio.Socket.send = original  # type: ignore[method-assign]
    if path is None:
        return
    original = _tapped["send"] = zmq.asyncio.Socket.send
    tap = Path(path).open("a", buffering=1)  # noqa: SIM115 - open while the tap is in

    def send(self, data, *args, **kwargs):
        endpoint = self.getsockopt(zmq.LAST_ENDPOINT)
        if isinstance(endpoint, bytes) and endpoint and isinstance(data, bytes | memoryview):
            tap.write(f"{endpoint.decode()}\t{base64.b64encode(bytes(data)).decode()}\n")
        return original(self, data, *args, **kwargs)

    zmq.asyncio.Socket.send = send  # type: ignore[method-assign]


def _is_kind(frame: bytes, kinds: list[str]) -> bool:
    """Whether ``frame`` carries a message tagged with one of ``kinds`` (MessagePack spells
    a short tag as a length byte and its text)."""
    return any(bytes([0xA0 | len(kind)]) + kind.encode() in frame for kind in kinds)


def replay(tap_dir: str, seconds: float, seed: int, rate: float, stop: dict[str, bool],
           kinds: list[str] | None = None) -> dict[str, int]:
    """Follow the tap files in ``tap_dir`` for ``seconds`` (or until ``stop["now"]``),
    replaying captured frames (of ``kinds``, if given; each ``rate`` times on average) at
    random moments; returns what was captured and sent."""
    import zmq

    rng = random.Random(seed)
    context = zmq.Context()
    sockets: dict[str, zmq.Socket] = {}
    offsets: dict[Path, int] = {}
    due: list[tuple[float, int, str, bytes]] = []  # (when, tie-breaker, endpoint, frame)
    counts = {"captured": 0, "sent": 0}
    deadline = time.monotonic() + seconds

    def socket_to(endpoint: str) -> zmq.Socket:
        if endpoint not in sockets:
            push = context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDTIMEO, 0)
            push.connect(endpoint)
            sockets[endpoint] = push
        return sockets[endpoint]

    def follow() -> None:
        for tap in Path(tap_dir).glob("*.tap"):
            with tap.open() as lines:
                lines.seek(offsets.get(tap, 0))
                for line in iter(lines.readline, ""):
                    if not line.endswith("\n"):
                        break  # half-written: read it whole next time
                    offsets[tap] = lines.tell()
                    endpoint, encoded = line.rstrip("\n").split("\t")
                    frame = base64.b64decode(encoded)
                    counts["captured"] += 1
                    socket_to(endpoint)
                    if kinds and not _is_kind(frame, kinds):
                        continue
                    targets = [endpoint] if kinds else [
                        endpoint, *rng.sample(sorted(sockets), min(2, len(sockets)))]
                    replays = int(rate) + (rng.random() < rate - int(rate))
                    for _ in range(replays):
                        when = time.monotonic() + rng.uniform(0, _MAX_DELAY_SECONDS)
                        heapq.heappush(due, (when, rng.getrandbits(32), rng.choice(targets),
                                             frame))

    print("ready", flush=True)
    try:
        while not stop["now"] and time.monotonic() < deadline:
            follow()
            while due and due[0][0] <= time.monotonic():
                _, _, endpoint, frame = heapq.heappop(due)
                try:
                    socket_to(endpoint).send(frame)
                    counts["sent"] += 1
                except zmq.Again:
                    pass
            time.sleep(0.002)
    finally:
        for push in sockets.values():
            push.close(linger=0)
        context.term()
    return counts


if __name__ == "__main__":
    stopping = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(now=True))
    directory, duration, seed_text, rate_text, *wanted = sys.argv[1:]
    print(json.dumps(replay(directory, float(duration), int(seed_text), float(rate_text),
                            stopping, wanted)), flush=True)
    os._exit(0)
