"""Naming the process behind a failed sync.

When a sync fails, most processes fail with it: receivers hear that the sender aborted, a
sender's write fails because its receiver died. The manager collects every failure (and,
for processes that never answered, what they were doing) and puts the root cause in the
headline: a process that died, then one that stopped making progress or sent bad data, then
transport errors (which usually only echo one of those), then pure echoes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import ray
import ray.exceptions

from weightsync_core.api.errors import (
    GroupInitTimeoutError,
    MetadataError,
    SenderAbortedError,
    TransferError,
)
from weightsync_core.data.sync_layout import SyncLayout

__all__ = [
    "Culprit",
    "describe_exception",
    "is_death",
    "metadata_culprit",
    "rank_failures",
    "settings_mismatch",
    "stalled_processes",
]


@dataclass(frozen=True)
class Culprit:
    """The process a failed sync blames, and why."""

    name: str
    """As the manager names processes (:class:`~weightsync_core.data.sync_layout.SyncLayout`'s
    names): ``"actor_wg rank 0"``, ``"rollout rank 2 (...)"``, ``"replica 1"``."""
    verdict: str
    """What it did, e.g. ``"died"``, ``"stopped responding (...)"``."""


def describe_exception(exc: BaseException) -> str:
    """``"Type: first line"`` of an error (the cause, for errors that crossed Ray)."""
    exc = _cause(exc)
    if isinstance(exc, ray.exceptions.RayActorError):
        return f"{type(exc).__name__}: the worker process died or is unreachable"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:600]


def _cause(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and cause is not None:
        return cause
    return exc


def is_death(exc: BaseException | None) -> TypeGuard[ray.exceptions.RayActorError]:
    """Whether ``exc`` says the process behind a call died (or cannot be reached)."""
    return isinstance(exc, ray.exceptions.RayActorError)


def _priority(exc: BaseException) -> int:
    """0: a process died; 1: its own fault (bad data, a failing iterator or server); 2: a
    transport error (usually a symptom); 3: an echo of another rank's failure."""
    if is_death(exc):
        return 0
    cause = _cause(exc)
    if isinstance(cause, SenderAbortedError | asyncio.CancelledError | GroupInitTimeoutError):
        return 3
    if isinstance(cause, TransferError):
        return 2
    return 1


def _manager_name(peer: str, names: Sequence[str],
                  peers: Mapping[str, str] | None = None) -> str | None:
    """The manager's name (one of ``names``, as :class:`SyncLayout` names processes) for a
    process an engine calls ``actor rank N`` / ``rollout rank N``: ``peers[peer]`` where
    ``peers`` is given (a round of a sync whose rollout ranks the engines number within the
    round), else the name that starts with it."""
    if peers is not None:
        return peers.get(peer.strip())
    parsed = SyncLayout.parse_peer_name(peer)
    if parsed is None:
        return None
    side, rank = parsed
    # a rollout worker's name is its peer name followed by where it sits in its replica
    wanted = SyncLayout.actor_name(rank) if side == "actor" else SyncLayout.rollout_peer_name(rank)
    return next((name for name in names if name == wanted or name.startswith(f"{wanted} (")),
                None)


def rank_failures(
    failures: Sequence[tuple[str, BaseException]], names: Sequence[str],
    stalled: Sequence[Culprit] = (), peers: Mapping[str, str] | None = None,
) -> tuple[Culprit, str, BaseException]:
    """The root cause among ``failures`` (``(process, error)``): returns the culprit, the
    process that reported it and its error. ``names`` are every process of the stage
    (``peers``: the engines' names of them, see :func:`_manager_name`). A process that
    stopped making progress (``stalled``) is the culprit when the failures are only
    transport errors or echoes (they are what its neighbours saw)."""
    reporter, exc = min(failures, key=lambda failure: _priority(failure[1]))
    if stalled and _priority(exc) >= 2:
        return stalled[0], reporter, exc
    if is_death(exc):
        return Culprit(reporter, "died"), reporter, exc
    source = getattr(_cause(exc), "source", "")
    sender = _manager_name(source, names, peers) if source else None
    if sender is not None and sender != reporter:
        return Culprit(sender, f"sent data that failed verification on {reporter}"), reporter, exc
    return Culprit(reporter, "failed"), reporter, exc


def metadata_culprit(exc: BaseException, metadata: Sequence[Any]) -> tuple[int, str] | None:
    """The process whose ``prepare()`` metadata made ``build_topology`` fail with ``exc``:
    ``(its index in metadata, what was wrong with it)``, or None when no process stands out.

    A :class:`~weightsync_core.api.errors.MetadataError` says which (the core builders check
    every entry). Else, for an engine's own builder: after a ``KeyError``, the one process
    whose metadata is not a dict or lacks the key while others hold it; after a
    ``TypeError`` or ``AttributeError``, the one whose metadata is not a dict while others'
    are. Where every process returned the same (an engine at odds with its own builder), no
    process is blamed.
    """
    if isinstance(exc, MetadataError):
        return None if exc.index is None else (exc.index, exc.problem)
    odd = [index for index, entry in enumerate(metadata) if not isinstance(entry, Mapping)]
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        key = exc.args[0]
        odd = [index for index, entry in enumerate(metadata)
               if not isinstance(entry, Mapping) or key not in entry]
        problem = f"without {key!r}"
    elif isinstance(exc, TypeError | AttributeError):
        problem = "that is not a dict"
    else:
        return None
    if not odd or len(odd) == len(metadata):
        return None
    index = odd[0]
    entry = metadata[index]
    if not isinstance(entry, Mapping):
        problem = f"that is not a dict but {type(entry).__name__} {repr(entry)[:120]}"
    return index, problem


def settings_mismatch(
    expected: Mapping[str, Any], reported: Sequence[Any], names: Sequence[str]
) -> tuple[str, str] | None:
    """The first process (of ``names``, each with what it ``reported`` its engine was built
    with: :meth:`~weightsync_core.api.config.CheckpointEngineConfig.travel_settings`, or
    anything else where it could not say, which is not compared) whose settings differ from
    the manager's (``expected``): ``(its name, what it was built with, as an error says
    it)``, or None where every process that reported agrees with the manager. A process built
    with another backend is named for that alone (its other settings mean other things).
    """
    odd = [(name, differences) for name, settings in zip(names, reported, strict=True)
           if isinstance(settings, Mapping)
           and (differences := _differences(expected, settings))]
    if not odd:
        return None
    name, differences = odd[0]
    if len(differences) == 1:
        key, built, wanted = differences[0]
        what = f"was built with {key}={built!r} but this manager's config says {wanted!r}"
    else:
        what = (f"was built with {', '.join(f'{key}={built!r}' for key, built, _ in differences)}"
                " but this manager's config says "
                f"{', '.join(f'{key}={wanted!r}' for key, _, wanted in differences)}")
    others = [other for other, _ in odd[1:]]
    also = ""
    if others:
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        also = f" ({len(others)} other process(es) differ as well: {shown})"
    return name, f"{what}: build every process's engine from the manager's config{also}"


def _differences(
    expected: Mapping[str, Any], settings: Mapping[str, Any]
) -> list[tuple[str, Any, Any]]:
    """``(setting, the process's value, the manager's)`` of every setting both name and that
    differs; only the backend where that differs."""
    keys = ["backend"] if settings.get("backend") != expected.get("backend") else list(expected)
    return [(key, settings.get(key), expected.get(key)) for key in keys
            if key in settings and settings[key] != expected.get(key)]


def stalled_processes(
    progress: dict[str, dict[str, Any] | None], names: Sequence[str] = (),
    peers: Mapping[str, str] | None = None,
) -> list[Culprit]:
    """Processes that stopped making progress, worst first, from what each reported when
    asked (``None``: it did not answer in time): the silent ones, then those stuck in
    their server or weights iterator, then pairs that have waited on each other for
    :data:`STUCK_WAIT_SECONDS` or more (each waits for a message or a write the other
    never gets: the network between their hosts), or without such a pair the process others
    wait on at the stall's edge. ``names`` (and ``peers``, where given: see
    :func:`_manager_name`) translate the engines' names of peers (``rollout rank 2``) to the
    manager's."""
    silent = [Culprit(name, "stopped responding (frozen, or its event loop is blocked)")
              for name, report in progress.items() if report is None]
    busy = sorted(
        ((report["seconds"], name, report) for name, report in progress.items()
         if report is not None and report.get("state") in _STUCK_STATES),
        key=lambda entry: -entry[0],
    )
    return silent + [
        Culprit(name, _STUCK_STATES[report["state"]].format(
            seconds=seconds, tensor=report.get("tensors", 0) + 1))
        for seconds, name, report in busy
    ] + _mutual_waits(progress, names, peers)


STUCK_WAIT_SECONDS = 2.0
"""A wait on a peer this old when a sync fails counts as stuck (a healthy write of a 64 MiB
bucket takes half a second at 1 Gbit/s)."""


def _mutual_waits(
    progress: dict[str, dict[str, Any] | None], names: Sequence[str],
    peers: Mapping[str, str] | None = None,
) -> list[Culprit]:
    waits: dict[str, dict[str, tuple[str, float]]] = {}
    for name, report in progress.items():
        for wait in (report or {}).get("waiting", []):
            peer = _manager_name(wait["peer"], names, peers) or wait["peer"]
            if wait["seconds"] >= STUCK_WAIT_SECONDS and peer not in waits.get(name, {}):
                waits.setdefault(name, {})[peer] = (wait["what"], wait["seconds"])
    def tensors(name: str) -> int:
        return (progress.get(name) or {}).get("tensors", 0)

    # A stall spreads: behind a cut path, each process waits on its neighbours both ways.
    # The pair across the cut is the one where a side got nothing through at all; among
    # equals, the oldest wait.
    ranked = []
    for name, waited in waits.items():
        for peer, (what, seconds) in waited.items():
            if name in waits.get(peer, {}) and name < peer:
                ranked.append((min(tensors(name), tensors(peer)), -seconds, Culprit(
                    name, f"stopped making progress: it and {peer} have waited on each "
                          f"other for {seconds:.0f}s ({what}); is the network between "
                          "their hosts broken?")))
    if ranked:
        return [culprit for *_, culprit in sorted(ranked, key=lambda entry: entry[:2])]
    return _one_sided_waits(waits, tensors)


def _one_sided_waits(
    waits: dict[str, dict[str, tuple[str, float]]], tensors: Callable[[str], int]
) -> list[Culprit]:
    """Without a mutual wait (one side is busy in a call that marks no wait, such as
    connecting), blame the process that others wait on: first where the waiter got nothing
    through at all and the waited-on process did get data (the edge of the stall), then by
    the age of the wait."""
    ranked = [
        (tensors(name), -tensors(peer), -seconds, Culprit(
            peer, f"stopped delivering: {name} has waited on it for {seconds:.0f}s ({what}) "
                  f"and got {tensors(name)} tensors through; is {peer} stuck, or the "
                  "network between their hosts broken?"))
        for name, peers in waits.items() for peer, (what, seconds) in peers.items()
    ]
    return [culprit for *_, culprit in sorted(ranked, key=lambda entry: entry[:3])]


_STUCK_STATES = {
    "loading": "stopped making progress: its server has held tensor #{tensor} for {seconds:.0f}s",
    "producing": "stopped making progress: its weights iterator produced nothing for "
                 "{seconds:.0f}s",
}
