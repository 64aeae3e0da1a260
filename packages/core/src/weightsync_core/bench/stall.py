"""What syncs cost a replica that generates all the time: from the times its tokens came (a
client keeping it busy) and the windows the syncs ran in, each sync's stall (the longest
wait for a token across the sync, beyond the usual gap between tokens) and the tokens per
second during syncs and between them."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from weightsync_core.api.config import CheckpointEngineConfig
from weightsync_core.api.protocols import CheckpointEngineWorkerGroup, RolloutReplica
from weightsync_core.orchestration.manager import CheckpointEngineManager

__all__ = ["StallSummary", "SyncWindow", "alternate_syncs", "staged_and_stopped",
           "summarize_stalls"]


@dataclass
class SyncWindow:
    """One sync as the client saw it.

    Attributes:
        start: ``time.monotonic()`` when the sync was called.
        end: when it returned.
        mode: what kind of sync it was (``"staged"``, ``"stop-the-world"``, ...).
        pause_seconds: how long the replica was paused for it, as the manager measured
            (None where it did not say).
    """

    start: float
    end: float
    mode: str
    pause_seconds: float | None = None


@dataclass
class StallSummary:
    """Every sync of one mode, summarised (seconds; tokens per second).

    Attributes:
        mode: the syncs' mode.
        syncs: how many.
        stall_seconds: each sync's stall: the longest gap between two tokens of a client's
            stream that overlaps the sync, less the median gap outside syncs.
        sync_seconds: each sync's whole time.
        pause_seconds: each sync's pause, as the manager measured (where it did).
        tokens_per_second_during: tokens that came during this mode's syncs per second of
            them, summed over the streams.
    """

    mode: str
    syncs: int
    stall_seconds: list[float] = field(default_factory=list)
    sync_seconds: list[float] = field(default_factory=list)
    pause_seconds: list[float] = field(default_factory=list)
    tokens_per_second_during: float = 0.0


def _inside(time: float, windows: Sequence[SyncWindow]) -> bool:
    return any(window.start <= time <= window.end for window in windows)


def summarize_stalls(
    streams: Sequence[Sequence[float]], windows: Sequence[SyncWindow]
) -> tuple[dict[str, StallSummary], float, float]:
    """Summarise ``windows`` by mode, from ``streams`` (per client, the times its tokens
    came, in order: one request after another). Returns the summaries, the median gap
    between tokens outside syncs, and the tokens per second outside syncs (summed over the
    streams).

    Raises:
        ValueError: no token came outside the syncs (nothing to compare with).
    """
    outside_gaps = [later - earlier for stream in streams
                    for earlier, later in itertools.pairwise(stream)
                    if not _inside(earlier, windows) and not _inside(later, windows)]
    if not outside_gaps:
        raise ValueError("no two consecutive tokens came outside the syncs: run the client "
                         "longer between syncs")
    usual_gap = statistics.median(outside_gaps)
    first = min(stream[0] for stream in streams if stream)
    last = max(stream[-1] for stream in streams if stream)
    synced = sum(max(0.0, min(w.end, last) - max(w.start, first)) for w in windows)
    outside_tokens = sum(1 for stream in streams for t in stream if not _inside(t, windows))
    outside_rate = outside_tokens / max(last - first - synced, 1e-9)
    summaries: dict[str, StallSummary] = {}
    for window in windows:
        summary = summaries.setdefault(window.mode, StallSummary(window.mode, 0))
        summary.syncs += 1
        summary.sync_seconds.append(window.end - window.start)
        if window.pause_seconds is not None:
            summary.pause_seconds.append(window.pause_seconds)
        overlapping = [later - earlier for stream in streams
                       for earlier, later in itertools.pairwise(stream)
                       if earlier <= window.end and later >= window.start]
        summary.stall_seconds.append(max(0.0, max(overlapping, default=0.0) - usual_gap))
    for mode, summary in summaries.items():
        mine = [w for w in windows if w.mode == mode]
        tokens = sum(1 for stream in streams for t in stream if _inside(t, mine))
        seconds = sum(w.end - w.start for w in mine)
        summary.tokens_per_second_during = tokens / seconds if seconds else 0.0
    return summaries, usual_gap, outside_rate


def staged_and_stopped(config: CheckpointEngineConfig, actor_wg: CheckpointEngineWorkerGroup,
                       replicas: Sequence[RolloutReplica]) -> dict[str, CheckpointEngineManager]:
    """Two managers of the same processes: ``"staged"`` (``config`` as it is) and
    ``"stop-the-world"`` (``staging="never"``)."""
    return {"staged": CheckpointEngineManager(config, actor_wg, replicas),
            "stop-the-world": CheckpointEngineManager(replace(config, staging="never"),
                                                      actor_wg, replicas)}


async def alternate_syncs(
    managers: dict[str, CheckpointEngineManager], change: Callable[[int], Awaitable[Any]],
    rounds: int, gap_seconds: float,
) -> list[SyncWindow]:
    """``rounds`` times, a sync by each of ``managers`` in turn (``change(step)`` first: new
    weights on the actor side), ``gap_seconds`` apart (and before the first); each sync's
    window, its mode the manager's key, its pause the manager's ``pause_seconds``."""
    windows: list[SyncWindow] = []
    step = 0
    await asyncio.sleep(gap_seconds)
    for _ in range(rounds):
        for mode, manager in managers.items():
            step += 1
            await change(step)
            start = time.monotonic()
            metrics = await manager.update_weights(global_steps=step)
            windows.append(SyncWindow(start, time.monotonic(), mode,
                                      metrics.get("weightsync/pause_seconds")))
            await asyncio.sleep(gap_seconds)
    return windows
