"""gloo's listener, open only while a group forms.

A gloo device listens on one TCP port for its peers' connections. torch 2.13's gloo keeps
every connection it accepted whose first bytes (gloo's handshake) never came, for the life
of the device: an outsider who opens and closes connections to that port leaks one file
descriptor each and, at the process's descriptor limit, gloo aborts the process
(``listener.cc accept: Too many open files``). No key or handshake of weightsync's can sit
in front of that port without copying every byte gloo moves.

What weightsync does instead: the listener is needed only until every pair of the group is
connected (gloo's pairs connect while the ``ProcessGroupGloo`` is built, and never again).
Once built, :func:`close_listener` puts a socket no one can reach (a Unix socket whose path
was removed) in place of the listening one under the same descriptor number: gloo's event
loop, which still watches that number, finds nothing to accept, and the port is closed to
everyone (a connection is refused, costing the process nothing). While a group forms,
:class:`FormationGuard` counts the connections the listener holds beyond the group's own
and closes the listener once they pass :func:`stray_connection_limit` (4,096, or half the
descriptors the process has left where that is fewer): the group then fails to form (its
missing peers are named) instead of the process dying, and destroying the failed group
frees every descriptor gloo kept.

The limit is a count, not a rate: an outsider churning connections at the port keeps each
one it opens while the group forms, so the group's formation time under load sets how many
arrive. On 2 busy cores a group of 5 took up to 0.5 s to form and held up to 446 stray
connections from the conformance suite's churner (which opens them 256 at a time); at a
limit of 512 that failed syncs through a churn, so the limit is eight times that.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import tempfile
import threading
from dataclasses import dataclass

__all__ = [
    "MAX_STRAY_CONNECTIONS",
    "FormationGuard",
    "GlooListener",
    "close_listener",
    "find_new_listener",
    "listening_sockets",
    "stray_connection_limit",
]

MAX_STRAY_CONNECTIONS = 4096
"""Connections a forming group's listener may hold beyond its peers' before it is closed
(each costs one file descriptor, a socket's kernel memory and gloo's few hundred bytes for
it until the failed group is destroyed), where the process has the descriptors to spare
(:func:`stray_connection_limit`)."""
_GUARD_INTERVAL = 0.01
"""Seconds between two counts of a forming group's connections."""


@dataclass(frozen=True)
class GlooListener:
    """A listening socket of this process: its descriptor, kernel inode and port."""

    fd: int
    inode: int
    port: int


def stray_connection_limit() -> int:
    """How many stray connections a forming group's listener may hold in this process:
    :data:`MAX_STRAY_CONNECTIONS`, or half the descriptors the process has left under its
    soft limit where that is fewer (gloo aborts the process when ``accept`` runs out)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    left = soft - len(os.listdir("/proc/self/fd"))
    return max(0, min(MAX_STRAY_CONNECTIONS, left // 2))


def _socket_inodes() -> dict[int, int]:
    """This process's socket descriptors, by kernel inode."""
    inodes: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:["):
                inodes[int(target[8:-1])] = int(name)
    return inodes


def _listening_port(fd: int) -> int | None:
    """The port descriptor ``fd`` listens on, if it is a listening TCP socket."""
    try:
        with socket.socket(fileno=os.dup(fd)) as probe:
            if probe.family not in (socket.AF_INET, socket.AF_INET6) or not probe.getsockopt(
                    socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return None
            return probe.getsockname()[1]
    except OSError:
        return None


def listening_sockets() -> dict[int, GlooListener]:
    """This process's listening TCP sockets, by inode."""
    found: dict[int, GlooListener] = {}
    for inode, fd in _socket_inodes().items():
        port = _listening_port(fd)
        if port is not None:
            found[inode] = GlooListener(fd, inode, port)
    return found


def find_new_listener(before: dict[int, GlooListener]) -> GlooListener:
    """The one listening socket this process has now and did not have in ``before``.

    Raises:
        RuntimeError: none, or more than one, appeared (another thread opened a listener at
            the same moment): the caller cannot tell which is gloo's.
    """
    new = [listener for inode, listener in listening_sockets().items() if inode not in before]
    if len(new) != 1:
        raise RuntimeError(f"expected gloo's device to open one listening socket, found "
                           f"{len(new)} new ({[listener.port for listener in new]})")
    return new[0]


def _local_port(fd: int) -> int | None:
    """The local port of TCP socket ``fd`` (None for anything else)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as probe:
            if probe.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            return probe.getsockname()[1]
    except OSError:
        return None


class _PortCensus:
    """Counts this process's connections on one local port, looking only at descriptors
    that are new since its last count (by kernel inode)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._seen: dict[int, bool] = {}
        """Inodes of sockets already looked at, and whether they are on ``port``."""

    def count(self) -> int:
        """Connections on ``port`` now."""
        inodes = _socket_inodes()
        for inode, fd in inodes.items():
            if inode not in self._seen:
                self._seen[inode] = _local_port(fd) == self.port
        self._seen = {inode: on_port for inode, on_port in self._seen.items()
                      if inode in inodes}
        return sum(self._seen.values())


def close_listener(listener: GlooListener) -> None:
    """Close ``listener`` for good while keeping its descriptor number valid: a Unix socket
    that listens under a path already removed (nothing can connect to it, so it never
    becomes readable and ``accept`` on it only says "try again") replaces the TCP socket.
    The TCP socket closes (pending connections are reset); the owner of the descriptor
    (gloo) closes the replacement when it closes its device.

    Raises:
        RuntimeError: ``listener.fd`` no longer is that socket.
    """
    with tempfile.TemporaryDirectory(prefix="weightsync-closed-") as folder:
        unreachable = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            unreachable.bind(os.path.join(folder, "listener"))
            unreachable.listen(1)
            unreachable.setblocking(False)
            if os.readlink(f"/proc/self/fd/{listener.fd}") != f"socket:[{listener.inode}]":
                raise RuntimeError(f"descriptor {listener.fd} is no longer gloo's listener")
            os.dup2(unreachable.fileno(), listener.fd, inheritable=False)
        finally:
            unreachable.close()  # the path is removed with the folder: no one can connect


class FormationGuard:
    """Watches a forming group's listener from a thread of its own, and closes it once this
    process holds more than ``limit`` connections on its port beyond the group's ``peers``
    (a flood).

    Args:
        listener: gloo's listening socket.
        peers: the connections the group itself makes to this listener (at most the group's
            size minus one).
        limit: the stray connections tolerated (:func:`stray_connection_limit` when not
            given).
    """

    def __init__(self, listener: GlooListener, peers: int, limit: int | None = None) -> None:
        self.listener = listener
        self.flooded = False
        """Whether the guard closed the listener because of stray connections."""
        self.limit = stray_connection_limit() if limit is None else limit
        """The stray connections tolerated."""
        self._threshold = peers + self.limit
        self._census = _PortCensus(listener.port)
        self._lock = threading.Lock()
        self._closed = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="weightsync-gloo-guard",
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(_GUARD_INTERVAL):
            if self._census.count() > self._threshold:
                self.flooded = True
                self.close()
                return

    def close(self) -> None:
        """Close the listener (once) and stop watching."""
        self._done.set()
        with self._lock:
            if not self._closed:
                self._closed = True
                close_listener(self.listener)

    def __enter__(self) -> FormationGuard:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
        if threading.current_thread() is not self._thread:
            self._thread.join()
