"""The interfaces the manager needs from worker groups, replicas and inference servers.

The trainer (or any third party) implements these;
:mod:`weightsync_core.orchestration.ray_group` has a small Ray implementation for tests and
simple deployments.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["CheckpointEngineWorkerGroup", "PreparedSwitch", "RolloutReplica", "ServerAdapter"]


@runtime_checkable
class CheckpointEngineWorkerGroup(Protocol):
    """A group of Ray actors that each own a checkpoint engine (``actor_wg`` or rollout).

    Methods return one Ray ``ObjectRef`` per rank, in rank order.
    """

    def __init__(self, workers: Sequence[Any]) -> None:
        """A group of the Ray handles ``workers`` (in rank order); how the manager builds
        the rollout side's group from the replicas' workers."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        ...

    def execute_checkpoint_engine(self, method: str, **per_rank_kwargs: list[Any]) -> list[Any]:
        """Call ``engine.<method>(**kwargs_i)`` on each rank ``i`` (``kwargs_i[k] = v[i]``)."""
        ...

    def update_weights(
        self, global_steps: int | None = None, allow_manifest_change: bool = False,
        **delta: str | None,
    ) -> list[Any]:
        """Run each rank's side of the transfer (send on actor ranks, receive on rollout).

        The manager passes ``allow_manifest_change=True`` (forward it to each rank's
        ``update_weights``) only when its caller announced a change of the model's layout;
        a group that never sees it may omit the parameter. Likewise ``delta_base`` and
        ``delta_version`` (forward them as they are), only where ``config.delta`` is set."""
        ...


@runtime_checkable
class RolloutReplica(Protocol):
    """One inference server instance, served by one or more rollout workers.

    A sync calls, on every replica: ``abort_all_requests``, ``release_kv_cache``, then (after
    the transfer) ``resume_kv_cache`` and ``resume_generation``. verl's replicas fit as they
    are; ``sleep()`` and ``wake_up()`` are optional (for the manager's ``sleep_replicas`` and
    ``wake_up_replicas``). An optional ``worker_group_class`` attribute names the class of
    the rollout side's worker group (default: the manager's ``default_rollout_group_class``).

    Staged syncs reach each worker (``stage_weights``, ``commit_staged``, ...), unless the
    replica switches as a whole: one whose workers are ranks of one process (a vLLM engine
    of several tensor-parallel workers) has ``switch_to_staged(mode, timeout_seconds)``
    (pause, commit every worker's stage, roll back every worker where one fails, resume;
    raises where it failed) and ``discard_staged()``, both awaitable; its workers then need
    only ``weights_status`` (a Ray-style ``.remote()`` call)."""

    @property
    def workers(self) -> Sequence[Any]:
        """Ray handles of the replica's ``CheckpointEngineWorker`` actors, in rank order."""
        ...

    async def abort_all_requests(self) -> None:
        """Stop in-flight generation before the weights change."""
        ...

    async def release_kv_cache(self) -> None:
        """Free KV-cache memory for the duration of the sync."""
        ...

    async def resume_kv_cache(self) -> None:
        """Restore the KV cache after the sync (counterpart of :meth:`release_kv_cache`)."""
        ...

    async def resume_generation(self) -> None:
        """Serve again with the new weights."""
        ...


@runtime_checkable
class ServerAdapter(Protocol):
    """The inference server inside a rollout worker process, as the engine sees it.

    The tensors ``update_weights`` receives are the server's own, with delta sync too: it may
    keep them or convert them in place, and no later sync changes them (save the tensors
    it offers for patching in place, below).

    Optional: ``patchable_weights() -> Mapping[str, torch.Tensor]``, the server's own weight
    tensors by the names syncs send (detached, contiguous), which delta syncs may patch in
    place. Where a received tensor has the shape and dtype of the server's, the worker then
    keeps no copy of its own (:class:`~weightsync_core.data.delta.DeltaReceiver`), and
    ``update_weights`` receives the server's tensor itself, already patched: skip the copy
    where the received tensor shares the target's storage. Only for servers that load
    tensors as they are (no fusing or re-layout on load).

    Optional: ``check_staged_weight(name, tensor)`` (plain or async), called for each tensor
    of a staged sync as it arrives, before the server loads any of it: raise to refuse a
    tensor the server could not load (an unknown name, a shape that does not fit), so that
    the refusal comes in phase 1, while the server serves its version untouched, not in the
    commit.

    Optional: ``swap_weights(tensors, version) -> dict[str, torch.Tensor]``: adopt the
    staged ``tensors`` (by name; the stage's own, which no one else writes) as the weights it
    serves, all or nothing, and return the tensors it served before (a staged commit then
    copies nothing, and rolling it back swaps those in again).

    Optional: ``prepare_weights(tensors, version) -> PreparedSwitch`` (plain or async):
    once a stage is whole and checked, still in phase 1 and without changing what the
    server serves, build everything the server needs to serve ``tensors`` (a server that
    converts weights on load, as vLLM's kernels do, converts them here); the commit is then
    :meth:`PreparedSwitch.apply`, under the pause. Raising refuses the stage in phase 1.

    Optional: ``pause_generation(mode)`` (``"keep"``, ``"drain"``, ``"abort"``; see
    :attr:`~weightsync_core.api.config.CheckpointEngineConfig.pause_mode`), the pause of a
    staged commit; without it, ``abort_all_requests()`` pauses the server."""

    async def update_weights(
        self,
        weights: AsyncIterator[tuple[str, torch.Tensor]],
        global_steps: int | None = None,
    ) -> None:
        """Consume every received ``(name, tensor)`` and load it into the model."""
        ...


@runtime_checkable
class PreparedSwitch(Protocol):
    """A server's switch to a staged version, built off the pause by its adapter's
    ``prepare_weights`` (:class:`ServerAdapter`): the commit applies it under the pause.

    Attributes:
        nbytes: bytes it holds besides the server's own weights (the prepared version until
            :meth:`apply`, then what :meth:`undo` needs).
    """

    nbytes: int

    def apply(self) -> None:
        """Make the prepared version the one the server serves, all or nothing (raising
        leaves the server serving its version), keeping what :meth:`undo` needs."""
        ...

    def undo(self) -> None:
        """After :meth:`apply`: serve the version it replaced again."""
        ...

    def release(self) -> None:
        """Drop what it holds (the prepared version, or after :meth:`apply` the replaced
        one): it will be neither applied nor undone."""
        ...
