"""Exceptions raised by weightsync.

Every error says what went wrong and, where there is one, how to fix it. Failures during a
sync name the stage and the rank (or peer) that failed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = [
    "AdapterMismatchError",
    "BackendLoadError",
    "BackendNotFoundError",
    "BackendNotInstalledError",
    "BackendRegistrationError",
    "EmptyWeightsError",
    "EngineOptionsError",
    "GroupInitTimeoutError",
    "MalformedMessageError",
    "ManifestChangedError",
    "MetadataError",
    "PluginError",
    "SenderAbortedError",
    "SyncStageError",
    "SyncTimeoutError",
    "TransferError",
    "UnauthenticatedMessageError",
    "VerificationError",
    "WeightSyncError",
    "failed_stage",
    "in_stage",
]


class WeightSyncError(RuntimeError):
    """Base class of every error weightsync raises on purpose.

    Subclasses keep their extra attributes optional so that errors pickle across Ray.
    """


class BackendNotFoundError(WeightSyncError, LookupError, ValueError):
    """No checkpoint-engine backend of that name is registered or known (also a
    ``ValueError``, which is what verl's registry raises and its callers catch)."""


class BackendNotInstalledError(BackendNotFoundError):
    """The backend is a known first-party backend whose package is not installed."""


class BackendLoadError(BackendNotFoundError):
    """The backend's package is installed but importing it (or its native library) failed."""


class BackendRegistrationError(WeightSyncError, TypeError):
    """A backend registration was refused (duplicate name or not a ``CheckpointEngine``)."""


class PluginError(WeightSyncError, ValueError):
    """A custom module or class named in configuration was refused or did not load."""


class EngineOptionsError(WeightSyncError, ValueError):
    """An ``engine_kwargs`` entry was refused on the driver (an unknown option, a value of the
    wrong type or out of range), or, for what depends on the machine (a ``host`` that is no
    address of it), where the engine is built. The message names the backend, the option,
    the value given and what is accepted."""


class MetadataError(WeightSyncError, ValueError):
    """What a process's ``prepare()`` returned is not what its engine's topology needs: not a
    dict, a key missing, or a value of the wrong kind (a process that lies, or an engine at
    odds with its own builder).

    Attributes:
        index: the process's place in the metadata (actor ranks first, then rollout
            workers), when known; the manager names the process from it.
        problem: what is wrong, as in "returned metadata <problem> from prepare()", e.g.
            ``"without 'endpoint'"``.
    """

    def __init__(self, message: str, *, index: int | None = None, problem: str = "") -> None:
        super().__init__(message)
        self.index = index
        self.problem = problem


class SyncStageError(WeightSyncError):
    """A stage of a weight sync failed on one worker.

    Attributes:
        stage: the sync stage that failed (``prepare``, ``transfer``, ...).
        worker: who failed, e.g. ``"rollout rank 2 (replica 1, worker 0)"``.
        host: the address of ``worker``'s host, when the manager knows it.
    """

    def __init__(
        self, message: str, *, stage: str = "", worker: str | None = None,
        host: str | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.worker = worker
        self.host = host


class SyncTimeoutError(SyncStageError, TimeoutError):
    """A sync stage did not finish within the configured timeout.

    Attributes:
        pending: every process the stage still waited on.
        worker: the one that stopped making progress, when it could be told (else all of
            ``pending``).
    """

    def __init__(
        self, message: str, *, stage: str = "", pending: list[str] | None = None,
        culprit: str | None = None, host: str | None = None,
    ) -> None:
        pending = pending or []
        super().__init__(message, stage=stage, worker=culprit or ", ".join(pending) or None,
                         host=host)
        self.pending = pending


class GroupInitTimeoutError(WeightSyncError, TimeoutError):
    """A weight-sync process group could not form because some ranks never arrived."""

    def __init__(self, message: str, *, missing_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks or []


class TransferError(WeightSyncError):
    """A transport reported a failure moving a bucket.

    Attributes:
        peer: the remote endpoint involved.
        stage: what the engine was doing.
        code: the transport's return code or state, when it has one.
    """

    def __init__(
        self, message: str, *, peer: str = "", stage: str = "", code: object = None
    ) -> None:
        super().__init__(message)
        self.peer = peer
        self.stage = stage
        self.code = code


class SenderAbortedError(WeightSyncError):
    """The sending rank aborted the sync; receivers raise this instead of waiting forever."""


class VerificationError(WeightSyncError):
    """Received weights do not match the sender's manifest (missing, extra or corrupt).

    Attributes:
        tensors: the tensors concerned.
        source: the process that sent the bad data (``"actor rank 0"``), when known.
    """

    def __init__(
        self, message: str, *, tensors: list[str] | None = None, source: str = ""
    ) -> None:
        super().__init__(message)
        self.tensors = tensors or []
        self.source = source


class ManifestChangedError(VerificationError):
    """The weights' names, shapes or dtypes differ from the previous sync's, and the caller
    did not pass ``allow_manifest_change=True``."""


class AdapterMismatchError(WeightSyncError, ValueError):
    """An adapter sync refused before any byte moved: its two ends describe the adapter
    differently (rank, alpha, target modules), a server cannot serve it, or a tensor does not
    fit its description."""


class EmptyWeightsError(WeightSyncError, ValueError):
    """A sync carried no tensors at all (a sync that loads nothing is never a success)."""


class UnauthenticatedMessageError(WeightSyncError):
    """A network message did not carry this sync's authentication tag (it comes from outside
    the sync, from an earlier sync, or was altered on the way)."""


class MalformedMessageError(WeightSyncError, ValueError):
    """An authenticated network message does not match the wire schema."""


_STAGE_ATTRIBUTE = "weightsync_stage"


@contextlib.contextmanager
def in_stage(stage: str) -> Iterator[None]:
    """Mark an error raised inside as raised in sync stage ``stage``, for a process that runs
    several stages in one call (:data:`~weightsync_core.api.config.BEGIN_SYNC`); the mark
    crosses Ray with the error (:func:`failed_stage` reads it)."""
    try:
        yield
    except Exception as exc:
        if failed_stage(exc) is None:
            setattr(exc, _STAGE_ATTRIBUTE, stage)
        raise


def failed_stage(exc: BaseException) -> str | None:
    """The stage :func:`in_stage` marked ``exc`` (or, for an error that crossed Ray, its
    cause) with; None where it was not marked."""
    for error in (exc, getattr(exc, "cause", None)):
        stage = getattr(error, _STAGE_ATTRIBUTE, None)
        if isinstance(stage, str):
            return stage
    return None
