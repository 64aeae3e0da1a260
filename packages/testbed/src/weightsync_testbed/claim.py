"""One living process per testbed prefix: a lock the kernel drops when its holder dies.

Two runs with one prefix would take each other's bridge, namespaces and Ray port; a run
killed before its teardown leaves them behind, and the next ``ip link add`` fails with
"File exists". A :class:`PrefixClaim` tells the two apart: whatever carries the prefix while
no process holds its claim was left by a dead run and may be removed; while a living process
holds it, the next run waits for it (bounded) and then names it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from pathlib import Path

__all__ = ["PrefixClaim", "TestbedBusyError"]

_log = logging.getLogger(__name__)

CLAIM_DIR = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
"""Where the claims' lock files live (one per prefix; they stay, empty when free)."""


class TestbedBusyError(RuntimeError):
    """Another living process holds the testbed prefix."""

    __test__ = False  # not a pytest test class, whatever its name


class PrefixClaim:
    """An exclusive ``flock`` on ``CLAIM_DIR/weightsync-testbed-<prefix>.lock``.

    Args:
        prefix: the testbed prefix claimed.
        wait_seconds: how long :meth:`acquire` waits for a living holder to finish.
    """

    def __init__(self, prefix: str, wait_seconds: float = 300.0) -> None:
        self.prefix = prefix
        self.wait_seconds = wait_seconds
        self.path = CLAIM_DIR / f"weightsync-testbed-{prefix}.lock"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the claim now."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the claim, waiting up to ``wait_seconds`` for a living holder; raise
        :class:`TestbedBusyError` naming the holder when it is still there."""
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.wait_seconds
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _holder(fd)
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise TestbedBusyError(
                        f"testbed prefix {self.prefix!r} is in use by {holder} (waited "
                        f"{self.wait_seconds:g} s): wait for it to finish, or give this "
                        "testbed another prefix"
                    ) from None
                if not told:
                    _log.warning("testbed prefix %r is in use by %s: waiting up to %g s",
                                 self.prefix, holder, self.wait_seconds)
                    told = True
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Give the claim up (idempotent); the kernel does the same when the process dies."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _holder(fd: int) -> str:
    """``pid N (command line)`` of the claim's holder, as far as its lock file tells."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    if not text.isdigit():
        return "another process"
    try:
        command = Path(f"/proc/{text}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace").strip()
    except OSError:
        command = ""
    return f"pid {text}" + (f" ({command[:120]})" if command else "")
