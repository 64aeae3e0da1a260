"""The :class:`Testbed`: emulated hosts, their links and a Ray cluster across them, set up
and torn down as one."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType, TracebackType
from typing import Any

from weightsync_testbed.claim import PrefixClaim
from weightsync_testbed.cluster import RayCluster, kill_ray_processes
from weightsync_testbed.network import (
    Link,
    Network,
    NicBytes,
    check_available,
    remove_leftovers,
)

__all__ = ["Testbed", "cleanup"]

_log = logging.getLogger(__name__)


class Testbed:
    """N emulated hosts with shaped links and a Ray node each; the calling process becomes
    the Ray driver (in the root namespace, on the bridge).

    Use it as a context manager: everything is torn down on exit, on an exception, on
    Ctrl-C and on SIGTERM::

        with Testbed(hosts=["a0", "r0", "r1"], link=Link("1gbit")) as testbed:
            placement = testbed.placement(actors=["a0"], replicas=["r0", "r1"])
            ...

    Args:
        hosts: host names, or a count (hosts ``h0``, ``h1``, ...).
        link: every host's NIC (default 1 Gbit/s full duplex).
        prefix: first part of every namespace/interface name (one testbed per prefix: on
            entry, a testbed waits up to ``wait_seconds`` for a living process using the
            same prefix, and removes what a dead one left behind).
        cpus_per_host: logical CPUs each Ray node advertises.
        object_store_bytes: object store of each node.
        connect: join the cluster as its Ray driver on entry.
        wait_seconds: how long to wait for another process's testbed of the same prefix.
    """

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(
        self, hosts: Sequence[str] | int = 2, link: Link | None = None, prefix: str = "wst",
        cpus_per_host: int = 2, object_store_bytes: int = 1 << 30, connect: bool = True,
        wait_seconds: float = 300.0,
    ) -> None:
        names = [f"h{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        self.network = Network(names, link, prefix)
        self.claim = PrefixClaim(prefix, wait_seconds)
        self.cluster = RayCluster(self.network, cpus_per_host, object_store_bytes)
        self.connect = connect
        self._previous_handlers: dict[int, Any] | None = None

    @property
    def hosts(self) -> list[str]:
        """Host names, in order."""
        return list(self.network.hosts)

    @property
    def link(self) -> Link:
        """The links' shape when the testbed was made."""
        return self.network.link

    # -- life cycle ------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        check_available()
        self.claim.acquire()
        self._trap_signals()
        try:
            self._remove_what_a_dead_run_left()
            self.network.create()
            self.cluster.start()
            if self.connect:
                self._connect()
                self._trap_signals()
        except BaseException:
            self.close()
            raise
        return self

    def _remove_what_a_dead_run_left(self) -> None:
        """With the prefix claimed, anything still carrying it belongs to a run that died
        before its teardown (killed, or its machine restarted): remove it."""
        removed = cleanup(self.network.prefix)
        if any(removed.values()):
            _log.warning("removed what a dead testbed of prefix %r left behind: %s",
                         self.network.prefix, removed)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def _trap_signals(self) -> None:
        """SIGTERM raises KeyboardInterrupt (so the ``with`` block unwinds and tears down);
        once one of SIGTERM or Ctrl-C arrived, both are ignored until the teardown is done.
        Called again after ``ray.init``, which installs handlers of its own."""
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum: int, frame: FrameType | None) -> None:
            _ignore_interrupts()
            raise KeyboardInterrupt(f"signal {signum}: tearing the testbed down")

        if self._previous_handlers is None:
            self._previous_handlers = {
                signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)
            }
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def _restore_signals(self) -> None:
        if self._previous_handlers is None:
            return
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = None

    def _connect(self) -> None:
        import ray
        from ray._private import ray_constants
        from ray._raylet import (  # private Ray API, absent from ray/_raylet.pyi
            AuthenticationTokenLoader,  # pyright: ignore[reportAttributeAccessIssue]
            Config,  # pyright: ignore[reportAttributeAccessIssue]
        )

        os.environ.update(self.cluster.driver_env)
        # Ray read these when it was imported: make it read them again
        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
        ray.init(
            address=self.cluster.address, _node_ip_address=self.network.gateway,
            logging_level=logging.WARNING,
            runtime_env={"env_vars": {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}},
        )

    def close(self) -> None:
        """Disconnect, stop Ray everywhere, remove the network (idempotent). Ctrl-C and
        SIGTERM are ignored until the teardown is complete."""
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            _ignore_interrupts()
        try:
            with contextlib.suppress(Exception):
                import ray

                if ray.is_initialized():
                    ray.shutdown()
            if in_main:
                _ignore_interrupts()  # ray.shutdown() puts back the handlers it replaced
            try:
                self.cluster.stop()
            finally:
                try:
                    self.network.destroy()
                finally:
                    self.claim.release()
        finally:
            if in_main:
                self._restore_signals()

    # -- addressing and placement --------------------------------------------------------------
    def address(self, host: str) -> str:
        """The NIC address of ``host``."""
        return self.network.address(host)

    def host_of(self, address: str) -> str | None:
        """The host owning ``address``."""
        return self.network.host_of(address)

    def nic_bytes(self, host: str) -> NicBytes:
        """What ``host``'s NIC has sent and received so far."""
        return self.network.nic_bytes(host)

    def placement(self, actors: Sequence[str], replicas: Sequence[str]):
        """Where a harness puts actor ranks (round robin over ``actors``) and replicas (one
        host each, round robin over ``replicas``)."""
        from weightsync_testbed.placement import HostPlacement

        return HostPlacement(list(actors), list(replicas))

    # -- faults ----------------------------------------------------------------------------------
    def link_down(self, host: str) -> None:
        """``host``'s cable out."""
        self.network.link_down(host)

    def link_up(self, host: str) -> None:
        """``host``'s cable back in."""
        self.network.link_up(host)

    def partition(self, first: str, second: str) -> None:
        """``first`` and ``second`` cannot reach each other (everyone else still can)."""
        self.network.partition(first, second)

    def heal(self, first: str, second: str) -> None:
        """Undo :meth:`partition`."""
        self.network.heal(first, second)

    def set_loss(self, host: str, percent: float) -> None:
        """Random packet loss on ``host``'s NIC, both directions."""
        self.network.set_loss(host, percent)

    def set_delay(self, host: str, milliseconds: float) -> None:
        """Added latency on ``host``'s outgoing packets (needs the kernel's netem)."""
        self.network.set_delay(host, milliseconds)

    @contextlib.contextmanager
    def fault_when(
        self, ready: Callable[[], bool], fault: Callable[[], None],
        repair: Callable[[], None] | None = None, timeout: float = 60.0, poll: float = 0.02,
    ) -> Iterator[threading.Event]:
        """Inject ``fault`` from a thread as soon as ``ready()`` is true (for example, when a
        receiver reports its third tensor), while the ``with`` body runs a sync; ``repair``
        runs on exit. The yielded event is set once the fault is in."""
        injected = threading.Event()
        stop = threading.Event()

        def watch() -> None:
            deadline = time.monotonic() + timeout
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    is_ready = ready()
                except Exception:  # e.g. a probe of a process still starting
                    is_ready = False
                if is_ready:
                    fault()
                    injected.set()
                    return
                time.sleep(poll)

        thread = threading.Thread(target=watch, name="testbed-fault", daemon=True)
        thread.start()
        try:
            yield injected
        finally:
            stop.set()
            thread.join(timeout + 1)
            if repair is not None and injected.is_set():
                repair()


def _ignore_interrupts() -> None:
    """Ignore SIGTERM and SIGINT, process-wide (whichever thread they reach)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def cleanup(prefix: str | None = None) -> dict[str, list]:
    """Remove what a crashed testbed left: its Ray processes, namespaces and interfaces
    (``prefix``: of that testbed only; ``None``: of every testbed)."""
    pids = kill_ray_processes(prefix)
    removed = remove_leftovers(prefix)
    return {"ray_processes": pids, **removed}
