"""The typed handshake every weightsync engine family implements, and verl's untyped one
built from it.

An engine family declares what each process announces (:attr:`TypedEngine.metadata_type`)
and what each rank joins the sync with (:attr:`TypedEngine.arguments_type`), both
:class:`~weightsync_core.api.handshake.Handshake` structures, and implements three typed
hooks: :meth:`~TypedEngine.announce`, :meth:`~TypedEngine.plan` and
:meth:`~TypedEngine.join`. The verl-shaped methods the manager and verl's worker groups call
(``prepare() -> dict``, ``build_topology(...) -> (dict of lists, dict of lists)``,
``init_process_group(**kwargs)``) carry them as plain data and check them once where they
arrive: a process whose metadata is not its engine's is named in a
:class:`~weightsync_core.api.errors.MetadataError`, arguments that are not the engine's are
refused before anything connects.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar, cast

from weightsync_core.api.engine import CheckpointEngine
from weightsync_core.api.errors import MetadataError, WeightSyncError
from weightsync_core.api.handshake import Handshake, HandshakeMismatch, from_wire, to_wire
from weightsync_core.data.sync_layout import SyncLayout

__all__ = ["TypedEngine", "decode_metadata", "wire_columns"]

M = TypeVar("M", bound=Handshake)
A = TypeVar("A", bound=Handshake)


def decode_metadata(layout: SyncLayout, metadata: Sequence[Any], kind: type[M]) -> list[M]:
    """Every process's ``prepare()`` metadata (actor ranks first, then the rollout workers of
    ``layout``) as ``kind``.

    Raises:
        MetadataError: naming the first process whose metadata is not a ``kind`` (its
            ``index``), what is wrong and what it returned.
    """
    if len(metadata) != layout.world_size:
        raise MetadataError(
            f"{layout.actor_ranks} actor rank(s) and {layout.rollout_world_size} rollout "
            f"worker(s) take part, but {len(metadata)} metadata entries were given")
    decoded = []
    for index, entry in enumerate(metadata):
        try:
            decoded.append(from_wire(entry, kind))
        except HandshakeMismatch as exc:
            name = (layout.actor_peer_name(index) if index < layout.actor_ranks
                    else layout.rollout_peer_name(index - layout.actor_ranks))
            raise MetadataError(
                f"{name} returned metadata {exc.problem} from prepare(); every process of the "
                f"sync must run the same engine, whose prepare() returns a {kind.__name__}",
                index=index, problem=exc.problem,
            ) from None
    return decoded


def wire_columns(arguments: Sequence[Handshake], kind: type[Handshake]) -> dict[str, list[Any]]:
    """Per-rank ``arguments`` in verl's shape: ``{field: [rank 0's value, ...]}``, plain
    data."""
    rows = [to_wire(item) for item in arguments]
    return {name: [row[name] for row in rows] for name in kind.__struct_fields__}


class TypedEngine(CheckpointEngine, Generic[M, A]):
    """A checkpoint engine whose handshake is typed: subclasses set :attr:`metadata_type` and
    :attr:`arguments_type` and implement :meth:`announce`, :meth:`plan` and :meth:`join`;
    ``prepare``, ``build_topology``, ``build_replica_topology`` and ``init_process_group``
    (verl's shape, what the manager calls) are built from them."""

    metadata_type: ClassVar[type[Handshake]] = Handshake
    """What :meth:`announce` returns (the engine family's announcement)."""

    arguments_type: ClassVar[type[Handshake]] = Handshake
    """What :meth:`plan` gives each rank and :meth:`join` takes."""

    family: ClassVar[str] = "sync"
    """The engine family in words, for errors (``"a broadcast needs at least ..."``)."""

    @abstractmethod
    def announce(self) -> M:
        """Allocate what the sync needs (a reserved port, a bound channel) and say what the
        topology needs of this process."""

    @classmethod
    @abstractmethod
    def plan(cls, layout: SyncLayout, metadata: list[M]) -> tuple[list[A], list[A]]:
        """Every rank's arguments (actor ranks', rollout workers'), from every process's
        announcement; ``layout.replica_workers`` says which workers form a replica (each
        worker its own replica where the caller does not know)."""

    @abstractmethod
    def join(self, arguments: A) -> None:
        """Join this sync's communication group with this rank's arguments from :meth:`plan`."""

    # -- verl's shape, built from the typed hooks ---------------------------------------
    def prepare(self) -> dict[str, Any]:
        """:meth:`announce`, as plain data."""
        return to_wire(self.announce())

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """:meth:`plan` with every rollout worker its own replica."""
        return cls.build_replica_topology(actor_wg_world_size, [1] * rollout_world_size,
                                          metadata)

    @classmethod
    def build_replica_topology(
        cls, actor_wg_world_size: int, replica_sizes: list[int], metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """:meth:`plan` for ``replica_sizes[i]`` workers in replica ``i``: every process's
        metadata checked once, each rank's arguments as plain data.

        Raises:
            ValueError: no actor rank or no rollout worker.
            MetadataError: a process's metadata is not :attr:`metadata_type` (naming it).
        """
        layout = cls.sync_layout(actor_wg_world_size, replica_sizes)
        announced = decode_metadata(layout, metadata, cast(type[M], cls.metadata_type))
        actor, rollout = cls.plan(layout, announced)
        return wire_columns(actor, cls.arguments_type), wire_columns(rollout, cls.arguments_type)

    @classmethod
    def sync_layout(cls, actor_wg_world_size: int, replica_sizes: list[int]) -> SyncLayout:
        """The layout of a sync of these sizes.

        Raises:
            ValueError: no actor rank, or a replica without a rollout worker.
        """
        if actor_wg_world_size < 1 or not replica_sizes or min(replica_sizes) < 1:
            raise ValueError(
                f"a {cls.family} needs at least one actor rank and one rollout worker in "
                f"each replica, got actor_wg_world_size={actor_wg_world_size}, "
                f"replica_sizes={replica_sizes}")
        return SyncLayout(actor_wg_world_size, tuple(replica_sizes))

    def init_process_group(self, **kwargs: Any) -> None:
        """:meth:`join` with the arguments :meth:`build_topology` gave this rank.

        Raises:
            WeightSyncError: they are not :attr:`arguments_type` (naming the key).
        """
        try:
            arguments = from_wire(kwargs, self.arguments_type)
        except HandshakeMismatch as exc:
            raise WeightSyncError(
                f"{type(self).__name__}.init_process_group: arguments {exc.problem}; pass "
                f"what its build_topology() gave this rank (a {self.arguments_type.__name__})"
            ) from None
        self.join(cast(A, arguments))
