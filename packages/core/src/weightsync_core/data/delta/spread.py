"""A delta sender whose copy of the last version is spread over an actor's ranks, each
keeping and diffing only its own slice of every tensor."""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncIterator

import torch
import torch.distributed as dist

from weightsync_core.data.bucketing import WeightsSource, cast_for_rollout, iter_named_tensors
from weightsync_core.data.delta.codec import (
    DeltaBaselineError,
    DeltaPlan,
    DeltaSender,
    DeltaStats,
    layout_changed,
)
from weightsync_core.data.delta.patch import (
    PatchKind,
    build_patch,
    cheapest_kind,
    diff_into,
    flat_words,
)

__all__ = ["SpreadDeltaSender"]

_SLICE_ALIGNMENT = 8  # elements: slices start on 8-byte words of narrow dtypes


class _Trouble(enum.IntEnum):
    """Why a rank cannot diff a tensor (exchanged with the counts, so all ranks agree)."""

    NONE = 0
    OTHER_VERSION = 1
    LAYOUT = 2


class SpreadDeltaSender(DeltaSender):
    """The sending side of delta sync spread over the ranks of an actor's process group.

    Every rank of ``group`` iterates the same full tensors in step (as an FSDP actor's
    ``iter_weights`` gathers them, one at a time) and runs each sync's :meth:`stream` over
    them. Each rank keeps a host copy of, and diffs, only its own slice of each tensor (about
    1/N of its elements on each of N ranks); the ranks then exchange the positions that
    changed (every rank already has the new values), and each sending rank builds the
    patches. So no rank keeps more than about 1/N of the model, and the diff is spread too.

    A rank that cannot diff a tensor (it holds another version, say after a restart, or the
    tensor's layout changed) makes every rank raise the same error at that tensor, before
    its patch leaves; no rank waits for another that gave up.

    Args:
        group: the actor's process group (``torch.distributed``; None: the default group).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._on_host = dist.get_backend(group) == "gloo"
        self._layouts: dict[str, tuple[torch.Size, torch.dtype]] = {}

    def forget(self) -> None:
        super().forget()
        self._layouts = {}

    def stream(self, weights: WeightsSource, plan: DeltaPlan | None,
               rollout_dtype: torch.dtype | None, sending: bool = True) -> WeightsSource:
        """What this rank hands its engine: where the sync is delta-enabled, ``weights``
        diffed by every rank (:meth:`encode`), then patches where this rank sends
        (``sending``) and the tensors as they are where it only drains them; else
        ``weights`` as they are, this rank's copy dropped."""
        if plan is None:
            self.forget()
            return weights
        return self.encode(weights, plan, rollout_dtype, sending=sending)

    async def encode(
        self, weights: WeightsSource, plan: DeltaPlan, rollout_dtype: torch.dtype | None,
        who: str = "this actor rank", sending: bool = True,
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """``weights`` cast to ``rollout_dtype``, whole (a full sync) or, on a sending rank,
        as patches (a delta sync), each rank keeping its slice as this sync's version.

        Raises:
            DeltaBaselineError: a delta sync against a version some rank does not hold (on
                every rank, naming those ranks).
            ManifestChangedError: a delta sync meets a tensor that was not in the last
                version, or whose shape or dtype changed.
        """
        trouble = (_Trouble.OTHER_VERSION if plan.is_delta and self.version != plan.base
                   else _Trouble.NONE)
        self.version = None  # until this sync's stream ended complete
        stats = self.last_stats = DeltaStats()
        seen: set[str] = set()
        async for name, tensor in iter_named_tensors(weights):
            tensor = cast_for_rollout(tensor, rollout_dtype).detach().contiguous()
            words = flat_words(tensor)
            start, end = self._slice(words.numel())
            nbytes = tensor.numel() * tensor.element_size()
            seen.add(name)
            stats.elements += tensor.numel()
            stats.model_bytes += nbytes
            if not plan.is_delta:
                self.baselines[name] = words[start:end].to("cpu", copy=True)
                self._layouts[name] = (tensor.shape, tensor.dtype)
                stats.changed += tensor.numel()
                stats.wire_bytes += nbytes
                yield name, tensor
                continue
            began = time.perf_counter()
            if trouble == _Trouble.NONE and self._layouts.get(name) != (tensor.shape,
                                                                        tensor.dtype):
                trouble = _Trouble.LAYOUT
            positions = (diff_into(words[start:end], self.baselines[name]) + start
                         if trouble == _Trouble.NONE else words.new_empty(0, dtype=torch.long))
            counts = self._exchange(positions.numel(), trouble, name, tensor, plan, who)
            changed = sum(counts)
            needs_positions = cheapest_kind(words.numel(), changed, words.element_size()) in (
                PatchKind.POSITIONS, PatchKind.BITMASK)
            everyone = self._gathered(positions, counts, words.numel()) if needs_positions else None
            stats.changed += changed
            if not sending:
                stats.seconds += time.perf_counter() - began
                yield name, tensor
                continue
            patch, patch_stats = build_patch(tensor, everyone, changed)
            stats.seconds += time.perf_counter() - began
            stats.wire_bytes += patch_stats.nbytes
            yield name, patch
        self.end(plan, seen)
        self._layouts = {name: self._layouts[name] for name in seen if name in self._layouts}

    def _slice(self, numel: int) -> tuple[int, int]:
        """This rank's slice of a tensor of ``numel`` elements: ``[start, end)``."""
        def bound(rank: int) -> int:
            if rank >= self.size:
                return numel
            return numel * rank // self.size // _SLICE_ALIGNMENT * _SLICE_ALIGNMENT
        return bound(self.rank), bound(self.rank + 1)

    def _device(self, tensor: torch.Tensor) -> torch.device:
        """Where the group's collectives take their tensors."""
        return torch.device("cpu") if self._on_host else tensor.device

    def _exchange(self, changed: int, trouble: _Trouble, name: str, tensor: torch.Tensor,
                  plan: DeltaPlan, who: str) -> list[int]:
        """Every rank's count of changed elements in its slice of ``name``; raises on every
        rank where any rank could not diff it."""
        mine = torch.tensor([changed, int(trouble)], dtype=torch.long,
                            device=self._device(tensor))
        table = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(table, mine, group=self.group)
        rows = [row.tolist() for row in table]
        troubled = {kind: [rank for rank, row in enumerate(rows) if row[1] == kind]
                    for kind in (_Trouble.OTHER_VERSION, _Trouble.LAYOUT)}
        if troubled[_Trouble.OTHER_VERSION]:
            self.forget()
            raise DeltaBaselineError(
                f"{who}: actor rank(s) {troubled[_Trouble.OTHER_VERSION]} of the {self.size} "
                f"that keep the last version do not hold version {plan.base}, which this "
                "sync sends deltas against; nothing was sent, and the next sync is a full one"
            )
        if troubled[_Trouble.LAYOUT]:
            last = self._layouts.get(name)
            self.forget()
            raise layout_changed(name, last, tensor)
        return [row[0] for row in rows]

    def _gathered(self, positions: torch.Tensor, counts: list[int], numel: int
                  ) -> torch.Tensor:
        """The positions every rank found changed, ascending (each rank's slice follows the
        one before)."""
        dtype = torch.int32 if numel < 2**31 else torch.long
        mine = torch.zeros(max(counts), dtype=dtype, device=self._device(positions))
        mine[: positions.numel()] = positions
        parts = [torch.empty_like(mine) for _ in counts]
        dist.all_gather(parts, mine, group=self.group)
        return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])
