"""Typed options of the broadcast and ring engines (and of every backend built on them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from weightsync_core.api.options import EngineOptions

__all__ = ["CollectiveBroadcastOptions", "RingOptions"]


@dataclass(frozen=True)
class CollectiveBroadcastOptions(EngineOptions):
    """Options of the collective broadcast engines (``gloo``, ``nccl``, ``hccl``).

    Attributes:
        host: address this process binds for the group (default: ``WEIGHTSYNC_HOST``, the
            Ray node IP, or ``127.0.0.1``).
        group_name: prefix of this engine's keys in the rendezvous store.
        keep_buffers: keep bucket buffers allocated between syncs (no re-allocation and page
            faults on every sync); turn off to give the memory back after each sync.
        direct_send_megabytes: tensors at least this large (MiB) are broadcast from their
            own memory instead of being copied into a bucket (default: half a bucket; 0
            sends every tensor directly, a negative value never does). Each direct bucket
            costs one extra round trip, so only large tensors gain. The weight iterator must
            not modify a tensor's memory after yielding it.
        senders: actor ranks that send (rank 0 plus relays on rank 0's host), each to its
            own share of the rollout workers; 1 means rank 0 alone.
        multi_sender: verl's name for every actor rank on rank 0's host sending (as many
            ``senders`` as that host has actor ranks); give it or ``senders``, not both.
        rebuild_group: build a new group every sync instead of reusing the last one when
            the membership is unchanged.
        group_init_timeout: seconds group set-up may take before failing with the ranks
            that never arrived.
    """

    host: str | None = None
    group_name: str = "weightsync"
    keep_buffers: bool = True
    direct_send_megabytes: float | None = None
    senders: int = 1
    multi_sender: bool = False
    rebuild_group: bool = False
    group_init_timeout: float = 60.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.senders < 1:
            raise ValueError(f"option 'senders' must be a positive integer, got {self.senders}")
        if self.multi_sender and self.senders != 1:
            raise ValueError(
                f"give senders={self.senders} or multi_sender=True (every actor rank on rank "
                "0's host), not both"
            )
        if not self.group_init_timeout > 0:
            raise ValueError(
                f"option 'group_init_timeout' must be > 0 seconds, got {self.group_init_timeout}"
            )


@dataclass(frozen=True)
class RingOptions(EngineOptions):
    """Options of the pipelined ring engines (``nixl``, ``mooncake``).

    Attributes:
        device: ``"cpu"`` (host memory) or ``"cuda"``: where buckets live.
        host: address of this process's control channel (default: ``WEIGHTSYNC_HOST``, the
            Ray node IP, or ``127.0.0.1``).
        slots: receive buffers per rollout worker (2 = double buffering).
        keep_buffers: keep registered buffers between syncs; off, they are deregistered and
            freed in every ``finalize``.
        rebuild_group: verl's name for starting every sync afresh: after each sync, every
            peer is disconnected and the buffers are deregistered (as after a failure), so
            the next sync connects and registers again, as verl's engines do.
    """

    device: Literal["cpu", "cuda"] = "cpu"
    host: str | None = None
    slots: int = 2
    keep_buffers: bool = True
    rebuild_group: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.slots < 2:
            raise ValueError(
                f"option 'slots' must be an integer >= 2 (double buffering), got {self.slots}"
            )
