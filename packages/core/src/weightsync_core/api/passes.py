"""The seconds one process spends in each pass over a sync's bytes (cast and pack into a
bucket, checksum, transport write, copy out of registered memory, ...), so that a sync's
time can be split into the passes that make it (``weightsync/passes/<pass>`` in the
manager's metrics, the breakdown in ``weightsync bench``).

Passes may run at the same time (a bucket is written while the next is packed, a copy is
checked on a worker thread while the loop forwards): each figure is the time spent in that
pass, and the figures of one process can add up to more than its sync took.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

__all__ = ["PASS_METRIC_PREFIX", "PASS_PREFIX", "PassTimes", "pass_metrics", "passes_in",
           "passes_of"]

PASS_PREFIX = "pass_"
"""How a worker's figures name a pass: ``pass_<pass>_seconds``."""
_SUFFIX = "_seconds"
PASS_METRIC_PREFIX = "weightsync/passes/"
"""How the manager's metrics name a pass: ``weightsync/passes/<pass>``."""


class PassTimes:
    """Seconds spent in each named pass since :meth:`clear` (safe to add to from any
    thread)."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` more in pass ``name``."""
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Count the time the ``with`` block takes in pass ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def clear(self) -> None:
        """Forget every pass (a new sync begins)."""
        with self._lock:
            self._seconds = {}

    def as_dict(self) -> dict[str, float]:
        """The figures a worker reports: ``pass_<pass>_seconds`` per pass."""
        with self._lock:
            return {f"{PASS_PREFIX}{name}{_SUFFIX}": seconds
                    for name, seconds in self._seconds.items()}


class _Untimed(PassTimes):
    """The passes of an engine that times none: nothing is kept."""

    def add(self, name: str, seconds: float) -> None:
        """Nothing: no pass is kept."""


_UNTIMED = _Untimed()


def passes_of(engine: object) -> PassTimes:
    """``engine.passes`` (:attr:`~weightsync_core.api.engine.CheckpointEngine.passes`), or,
    for an engine not built on weightsync's (verl's own, driven by weightsync-verl's staging
    worker), a :class:`PassTimes` that keeps nothing."""
    passes = getattr(engine, "passes", None)
    return passes if isinstance(passes, PassTimes) else _UNTIMED


def pass_metrics(reports: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """``weightsync/passes/<pass>``: the longest any process of ``reports`` (what the
    workers of a sync reported) spent in each pass."""
    metrics: dict[str, float] = {}
    for report in reports:
        for key, seconds in report.items():
            if key.startswith(PASS_PREFIX) and key.endswith(_SUFFIX):
                name = f"{PASS_METRIC_PREFIX}{key[len(PASS_PREFIX):-len(_SUFFIX)]}"
                metrics[name] = max(metrics.get(name, 0.0), float(seconds))
    return metrics


def passes_in(metrics: Mapping[str, float]) -> dict[str, float]:
    """The passes of a sync's ``metrics`` (what ``update_weights`` returned): seconds by
    pass name."""
    return {key.removeprefix(PASS_METRIC_PREFIX): seconds for key, seconds in metrics.items()
            if key.startswith(PASS_METRIC_PREFIX)}
