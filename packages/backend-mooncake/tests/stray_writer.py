"""An outsider with a Mooncake Transfer Engine of its own and no key (run as a script by
``test_registered_memory.py``): it finds the Transfer Engines listening on the given ports of
127.0.0.1 (Mooncake's handshake hands anyone a segment's first registered buffer), then
obeys one command per line on stdin:

- ``write SECONDS``: after a random delay of up to ``SECONDS``, write 4 KiB of junk at a
  random offset of one random target's first registered buffer (a rollout worker's slot 0);
  answers ``wrote <target> <offset> <delay> <code>`` (code 0: it landed). Slots move when a
  failed sync re-registers them: a write that fails looks the targets up again afresh and
  tries once more (``wrote none 0 <delay> -1`` where that lookup found none);
- ``read``: read the first ``SPAN`` bytes of every target's first buffer; answers ``read``
  and, per target, the number of non-zero bytes seen (registered memory holding weights);
- ``quit``.

It prints ``ready <targets>`` once it has found them.
"""

import random
import sys
import threading
import time

import numpy as np
from mooncake.engine import TransferEngine

WRITE_BYTES = 4096
SPAN = 1 << 20
"""Bytes of each target's first buffer it writes into and reads (the test's bucket size)."""
LOOKUP_SECONDS = 15.0
"""How long a lookup of one port may take (a few milliseconds on an idle machine; seconds
when the machine runs other tests besides)."""


class Outsider:
    """A Transfer Engine of its own, its buffers, and where the targets' slots lie."""

    def __init__(self, ports: list[int], rng: random.Random) -> None:
        self.rng = rng
        self.junk = np.frombuffer(rng.randbytes(WRITE_BYTES), dtype=np.uint8).copy()
        self.seen = np.zeros(SPAN, dtype=np.uint8)
        self.sessions = [f"127.0.0.1:{port}" for port in ports]
        self.targets: dict[str, int] = {}
        self.engines_found = False
        self.engine = self._start()

    def _start(self) -> TransferEngine:
        engine = TransferEngine()
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise SystemExit("could not start a Transfer Engine")
        for buffer in (self.junk, self.seen):
            engine.register_memory(buffer.ctypes.data, buffer.nbytes)
        found: dict[str, int] = {}

        def look_up(session: str) -> None:
            try:
                address = engine.get_first_buffer_address(session)
            except Exception:  # not a Transfer Engine
                return
            if address:
                found[session] = address

        lookups = [threading.Thread(target=look_up, args=(session,), daemon=True)
                   for session in self.sessions]
        for lookup in lookups:
            lookup.start()
        for lookup in lookups:
            lookup.join(LOOKUP_SECONDS)
        self.targets = dict(found)
        if not self.engines_found:  # only Transfer Engines from now on; a later lookup that
            # finds none registered (a failed sync released them) keeps looking at all of them
            self.sessions = sorted(self.targets)
            self.engines_found = bool(self.sessions)
        return engine

    def write(self, delay_bound: float) -> str:
        delay = self.rng.uniform(0, delay_bound)
        time.sleep(delay)
        if not self.targets:  # the last lookup found none (a sync was re-registering)
            self.engine = self._start()
        if not self.targets:
            return f"wrote none 0 {delay:.3f} -1"
        session = self.rng.choice(sorted(self.targets))
        offset = self.rng.randrange(0, SPAN - WRITE_BYTES)
        code = self._write(session, offset)
        if code != 0:
            self.engine = self._start()  # a fresh engine fetches the moved slots
            code = self._write(session, offset)
        return f"wrote {session} {offset} {delay:.3f} {code}"

    def _write(self, session: str, offset: int) -> int:
        if session not in self.targets:
            return -1
        return self.engine.transfer_sync_write(session, self.junk.ctypes.data,
                                               self.targets[session] + offset, WRITE_BYTES)

    def read(self) -> str:
        self.engine = self._start()  # the slots' addresses as they are now
        counts = []
        for session, address in sorted(self.targets.items()):
            self.seen[:] = 0
            code = self.engine.transfer_sync_read(session, self.seen.ctypes.data, address,
                                                  SPAN)
            counts.append(f"{session}={int(np.count_nonzero(self.seen)) if code == 0 else -1}")
        return "read " + " ".join(counts)


def main() -> None:
    outsider = Outsider([int(port) for port in sys.argv[1].split(",")],
                        random.Random(int(sys.argv[2])))
    print("ready", " ".join(sorted(outsider.targets)), flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "write":
            print(outsider.write(float(command[1])), flush=True)
        elif command[0] == "read":
            print(outsider.read(), flush=True)
        else:
            break


if __name__ == "__main__":
    main()
