"""Threads of a nixl sender over many syncs (issue 23: "nixl sender gained 3 threads over
100 syncs (fds flat)").

Every sync, the ring's sender asks its transport to ``connect`` to the downstream neighbour
(already known: it returns at once) and then to ``write`` the bucket, each through
weightsync's blocking-call pool (``run_blocking``), one after the other. A
``ThreadPoolExecutor`` counts a thread idle only after the caller may already have seen its
result, so the write often found no idle thread and the pool started another: calls made
strictly one at a time grew it by a thread every so often (up to its 64). NIXL and UCX
themselves start no thread per connection, registration, write or disconnect.

Both tests read one fresh process (other tests' threads stay out of the count) with a real
pair of agents, and a Python thread keeping the GIL busy as a trainer's would (which makes
the race likely). Threads are counted by name: Python's name, else the kernel's.
"""

import json
import subprocess
import sys
import textwrap

import pytest

from weightsync_core.testing.profile import by_profile

SYNCS = by_profile(default=100, long=300)
"""Before the fix, the pool held 2-4 threads after 100 of these (in 8 runs of 8): the default
profile runs those 100, the long one 300."""
ABORTS = by_profile(default=10, long=30)
"""A thread started per disconnect, registration or connection would grow the process by 10
threads over the default profile's 10 aborts (the test allows none); the long one runs 30."""

_SCRIPT = textwrap.dedent("""
    import asyncio, collections, json, os, sys, threading, time
    import torch
    from weightsync_core.spi import run_blocking
    from weightsync_nixl import NixlTransport

    def threads_by_name():
        python = {t.native_id: t.name.rstrip("0123456789_") for t in threading.enumerate()}
        names = collections.Counter()
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as comm:
                    native = comm.read().strip()
            except FileNotFoundError:  # ended meanwhile
                continue
            names[python.get(int(tid), f"native:{native}")] += 1
        return dict(names)

    sender, receiver = NixlTransport(), NixlTransport()
    buffers = {}

    def register():
        buffers["bucket"] = torch.ones(64 << 10, dtype=torch.uint8)
        buffers["slot"] = torch.zeros_like(buffers["bucket"])
        sender.register(buffers["bucket"])
        buffers["remote"] = receiver.register(buffers["slot"])
        buffers["metadata"] = receiver.metadata()

    async def sync():  # the sender's calls of one sync
        peer = await run_blocking(sender.connect, buffers["metadata"])  # known: at once
        await run_blocking(sender.write, peer, buffers["bucket"], buffers["remote"], 30)
        return peer

    def abort(peer):  # what an abort and the next sync do: drop everything, start again
        sender.disconnect(peer)
        sender.deregister(buffers["bucket"])
        receiver.deregister(buffers["slot"])
        register()

    async def main(syncs, aborts):
        counts = {}
        peer = await sync()
        before = threads_by_name()
        for _ in range(syncs):
            peer = await sync()
        counts["syncs"] = before, threads_by_name()
        before = threads_by_name()
        for _ in range(aborts):
            abort(peer)
            peer = await sync()
        counts["aborts"] = before, threads_by_name()
        return counts

    register()
    done = threading.Event()

    def keep_the_gil_busy():
        while not done.is_set():
            pass

    sys.setswitchinterval(5e-4)  # 5 ms by default: every hand-over of the GIL waits that long
    trainer = threading.Thread(target=keep_the_gil_busy, name="trainer")
    trainer.start()
    start = time.monotonic()
    try:
        counts = asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
    finally:
        done.set()
        trainer.join()
    seconds = time.monotonic() - start
    assert torch.equal(buffers["slot"], buffers["bucket"])
    sender.close()
    receiver.close()
    print(json.dumps({"counts": counts, "seconds": seconds}))
""")


@pytest.fixture(scope="module")
def threads() -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    """Threads by name before and after the ``SYNCS`` syncs that follow the first, and
    before and after ``ABORTS`` aborts, each followed by a sync."""
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(SYNCS), str(ABORTS)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"
    result = json.loads(done.stdout.splitlines()[-1])
    print(f"{SYNCS} syncs and {ABORTS} aborts in {result['seconds']:.2f}s")
    return {phase: (before, after) for phase, (before, after) in result["counts"].items()}


def _grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after.get(name, 0) - before.get(name, 0) for name in {*before, *after}
            if after.get(name, 0) != before.get(name, 0)}


def test_sequential_syncs_keep_the_senders_threads_flat(threads):
    before, after = threads["syncs"]
    assert after.get("weightsync-blocking") == 1, (
        f"{after.get('weightsync-blocking')} blocking-pool threads for calls made one at a "
        f"time (1 is enough); threads after the first sync: {before}, after {SYNCS} more: "
        f"{after}"
    )
    assert not _grown(before, after), f"threads grew over {SYNCS} syncs: {_grown(before, after)}"


def test_reconnecting_and_reregistering_starts_no_thread(threads):
    """An abort disconnects the peer and drops the buffers; the next sync registers new
    ones and connects again (NIXL or UCX starting a thread per connection or registration
    would show here)."""
    before, after = threads["aborts"]
    grown = _grown(before, after)
    grown.pop("weightsync-blocking", None)  # the pool's own count: the test above
    assert not grown, (
        f"threads grew over {ABORTS} disconnects, re-registrations and reconnects: {grown} "
        f"(before: {before})"
    )
