"""The deployment layout of one weight sync: actor ranks, replicas, their workers, hosts.

A :class:`SyncLayout` says who takes part in a sync, checked once when it is built: how
many ``actor_wg`` ranks there are, how many rollout workers each replica has (replicas in
rollout-rank order, so replica 0's workers are rollout ranks ``0 .. n0 - 1``, replica 1's
follow, ...) and, where known, the host of every process. Everything else is derived from
it: the rollout world size, which replica a rollout rank belongs to, and the names by which
errors and blame refer to processes (``"actor_wg rank 0"``, ``"rollout rank 3 (replica 1,
worker 0)"``, ``"replica 1"``).

The manager builds one per sync; the topology builders and the planner take theirs from
it. This module belongs to the engine layer: it imports neither Ray nor the manager.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal, TypeVar

__all__ = ["SyncLayout"]

_T = TypeVar("_T")

_PEER_NAME = re.compile(r"(actor|rollout) rank (\d+)")
"""How engines name a peer (``actor rank 0``, ``rollout rank 2``): see
:meth:`SyncLayout.actor_peer_name`."""


def _count(field: str, value: object, minimum: int) -> int:
    """``value`` if it is an integer (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"SyncLayout.{field} must be an integer >= {minimum}, got {value!r}")
    return value


def _hosts(field: str, value: object, expected: int, what: str) -> tuple[str, ...] | None:
    """``value`` as a tuple of ``expected`` host names, or None (hosts not known)."""
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(
            f"SyncLayout.{field} must be None or a sequence of one host name (str) per "
            f"{what}, got {value!r}"
        )
    hosts = tuple(value)
    if len(hosts) != expected:
        raise ValueError(
            f"SyncLayout.{field} must name the host of each of the {expected} {what}(s), got "
            f"{len(hosts)}: {hosts!r}"
        )
    wrong = [(index, host) for index, host in enumerate(hosts) if not isinstance(host, str)]
    if wrong:
        index, host = wrong[0]
        raise ValueError(
            f"SyncLayout.{field}[{index}] must be a host name (str), got {host!r}"
        )
    return hosts


@dataclass(frozen=True)
class SyncLayout:
    """Who takes part in one sync: ``actor_ranks`` ranks of ``actor_wg`` and the rollout
    workers of each replica, in rollout-rank order; the hosts where known.

    Args:
        actor_ranks: ranks of ``actor_wg`` (its ``world_size``). 0 is accepted for an empty
            worker group (such a sync moves nothing; the topology builders refuse it).
        replica_workers: rollout workers of each replica, at least 1 each, replica by
            replica in rollout-rank order (a list is stored as a tuple). Empty for a sync
            without rollout workers (a colocated engine hands the weights over in the
            actor processes).
        actor_rank_hosts: the host of each actor rank, or None if not known.
        rollout_rank_hosts: the host of each rollout worker (by rollout rank), or None.

    Raises:
        ValueError: a field out of range; the message names the field, what was given
            and what is accepted.
    """

    actor_ranks: int
    replica_workers: tuple[int, ...] = ()
    actor_rank_hosts: tuple[str, ...] | None = None
    rollout_rank_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _count("actor_ranks", self.actor_ranks, 0)
        workers = self.replica_workers
        if isinstance(workers, str | bytes) or not isinstance(workers, Sequence):
            raise ValueError(
                "SyncLayout.replica_workers must be a sequence of worker counts (one integer "
                f">= 1 per replica, in rollout-rank order), got {workers!r}"
            )
        for index, count in enumerate(workers):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(
                    f"SyncLayout.replica_workers[{index}] (the workers of replica {index}) "
                    f"must be an integer >= 1, got {count!r}"
                )
        object.__setattr__(self, "replica_workers", tuple(workers))
        object.__setattr__(self, "actor_rank_hosts", _hosts(
            "actor_rank_hosts", self.actor_rank_hosts, self.actor_ranks, "actor rank"))
        object.__setattr__(self, "rollout_rank_hosts", _hosts(
            "rollout_rank_hosts", self.rollout_rank_hosts, self.rollout_world_size,
            "rollout worker"))

    @classmethod
    def flat(cls, actor_ranks: int, rollout_world_size: int) -> SyncLayout:
        """A layout whose replicas are not known: every rollout worker counts as a replica
        of its own (as ``build_topology``, which gets only the sizes, sees it)."""
        _count("rollout_world_size", rollout_world_size, 0)
        return cls(actor_ranks, (1,) * rollout_world_size)

    # -- sizes ---------------------------------------------------------------------------
    @property
    def rollout_world_size(self) -> int:
        """Rollout workers in all."""
        return sum(self.replica_workers)

    @property
    def num_replicas(self) -> int:
        """Replicas in the sync."""
        return len(self.replica_workers)

    @property
    def world_size(self) -> int:
        """Processes in the sync: the actor ranks and the rollout workers."""
        return self.actor_ranks + self.rollout_world_size

    @cached_property
    def _first_ranks(self) -> tuple[int, ...]:
        """The first rollout rank of each replica."""
        return tuple(itertools.accumulate(self.replica_workers[:-1], initial=0))

    def replica_of(self, rollout_rank: int) -> tuple[int, int]:
        """``(replica index, worker index inside the replica)`` of ``rollout_rank``.

        Raises:
            ValueError: ``rollout_rank`` is not one of this layout's rollout ranks.
        """
        self._check_rank("rollout_rank", rollout_rank, self.rollout_world_size)
        replica = bisect.bisect_right(self._first_ranks, rollout_rank) - 1
        return replica, rollout_rank - self._first_ranks[replica]

    def replica_ranks(self, replica: int) -> range:
        """The rollout ranks of replica ``replica``.

        Raises:
            ValueError: there is no replica ``replica``.
        """
        self._check_rank("replica", replica, self.num_replicas)
        first = self._first_ranks[replica]
        return range(first, first + self.replica_workers[replica])

    def split(self, per_process: Sequence[_T]) -> tuple[list[_T], list[_T]]:
        """Split ``per_process`` (one entry per process, actor ranks first, as ``prepare``'s
        metadata) into the actor ranks' entries and the rollout workers'.

        Raises:
            ValueError: ``per_process`` does not have one entry per process.
        """
        if len(per_process) != self.world_size:
            raise ValueError(
                f"expected metadata of {self.world_size} processes, got {len(per_process)}"
            )
        return list(per_process[: self.actor_ranks]), list(per_process[self.actor_ranks:])

    # -- names ---------------------------------------------------------------------------
    @staticmethod
    def actor_name(rank: int) -> str:
        """How errors and blame name actor rank ``rank``: ``"actor_wg rank 0"``."""
        return f"actor_wg rank {rank}"

    def rollout_name(self, rollout_rank: int) -> str:
        """How errors and blame name a rollout worker: ``"rollout rank 3 (replica 1,
        worker 0)"`` (its :meth:`rollout_peer_name`, then where it sits).

        Raises:
            ValueError: ``rollout_rank`` is not one of this layout's rollout ranks.
        """
        replica, worker = self.replica_of(rollout_rank)
        return f"{self.rollout_peer_name(rollout_rank)} (replica {replica}, worker {worker})"

    @staticmethod
    def replica_name(replica: int) -> str:
        """How errors name a replica (its lifecycle calls): ``"replica 1"``. Static: the
        manager names replicas outside a sync too."""
        return f"replica {replica}"

    @property
    def actor_names(self) -> list[str]:
        """The names of the actor ranks, in rank order."""
        return [self.actor_name(rank) for rank in range(self.actor_ranks)]

    @property
    def rollout_names(self) -> list[str]:
        """The names of the rollout workers, in rollout-rank order."""
        return [self.rollout_name(rank) for rank in range(self.rollout_world_size)]

    @property
    def names(self) -> list[str]:
        """Every process's name: actor ranks, then rollout ranks."""
        return self.actor_names + self.rollout_names

    @staticmethod
    def actor_peer_name(rank: int) -> str:
        """How engines name actor rank ``rank`` to their peers (``"actor rank 0"``, in
        ring neighbours and in what a process waits on); see :meth:`name_of_peer`."""
        return f"actor rank {rank}"

    @staticmethod
    def rollout_peer_name(rollout_rank: int) -> str:
        """How engines name a rollout worker to their peers: ``"rollout rank 2"``."""
        return f"rollout rank {rollout_rank}"

    @staticmethod
    def parse_peer_name(peer: str) -> tuple[Literal["actor", "rollout"], int] | None:
        """``("actor" | "rollout", rank)`` of an engine's name of a peer (see
        :meth:`actor_peer_name`), or None if ``peer`` is not one."""
        match = _PEER_NAME.fullmatch(peer.strip())
        if match is None:
            return None
        return ("actor" if match[1] == "actor" else "rollout"), int(match[2])

    def name_of_peer(self, peer: str) -> str | None:
        """The name errors use for the process an engine calls ``peer`` (``"rollout rank
        3"`` -> ``"rollout rank 3 (replica 1, worker 0)"``), or None if ``peer`` is not an
        engine's name of one of this layout's processes."""
        parsed = self.parse_peer_name(peer)
        if parsed is None:
            return None
        side, rank = parsed
        size = self.actor_ranks if side == "actor" else self.rollout_world_size
        if rank >= size:
            return None
        return self.actor_name(rank) if side == "actor" else self.rollout_name(rank)

    # -- hosts ---------------------------------------------------------------------------
    def with_hosts(self, hosts: Sequence[str]) -> SyncLayout:
        """This layout with the host of every process (``hosts``: actor ranks first, then
        rollout ranks, as the processes answered where they run)."""
        if len(hosts) != self.world_size:
            raise ValueError(
                f"SyncLayout.with_hosts needs the host of each of the {self.world_size} "
                f"processes (actor ranks, then rollout ranks), got {len(hosts)}"
            )
        return replace(self, actor_rank_hosts=tuple(hosts[: self.actor_ranks]),
                       rollout_rank_hosts=tuple(hosts[self.actor_ranks:]))

    def hosts_by_name(self) -> dict[str, str]:
        """The known host of each process by its name, and of each replica (the host of its
        first worker, where its lifecycle calls go) by :meth:`replica_name`."""
        hosts: dict[str, str] = {}
        if self.actor_rank_hosts is not None:
            hosts.update(zip(self.actor_names, self.actor_rank_hosts, strict=True))
        if self.rollout_rank_hosts is not None:
            hosts.update(zip(self.rollout_names, self.rollout_rank_hosts, strict=True))
            hosts.update({
                self.replica_name(replica): self.rollout_rank_hosts[first]
                for replica, first in enumerate(self._first_ranks[: self.num_replicas])
            })
        return hosts

    @staticmethod
    def _check_rank(field: str, value: int, size: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
            raise ValueError(
                f"{field} must be an integer in [0, {size}) for this layout, got {value!r}"
            )
