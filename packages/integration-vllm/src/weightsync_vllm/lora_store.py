"""The LoRA adapter versions one vLLM worker holds, built in memory from adapter syncs.

Each version of each adapter is one vLLM LoRA (a distinct int id, which the rollout actor
chooses so that every worker of its engine uses the same). A version the manager drops is
*retired*: requests no longer name it, but vLLM keeps it until the actor says no request in
flight uses it (:meth:`LoRAStore.release`), since a running request whose adapter vLLM no
longer holds makes vLLM load it from its path, and the failure kills the engine. vLLM drops
every adapter when it reloads the base weights; :meth:`LoRAStore.restore` adds them back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from weightsync_core import AdapterSpec, WeightSyncError
from weightsync_vllm.vllm_lora import (
    add_lora,
    build_lora,
    loaded_ids,
    lora_limits,
    lora_manager_of,
    remove_lora,
)

__all__ = ["LoRAStore"]


class LoRAStore:
    """The adapter versions of one vLLM worker (the server side of weightsync's
    ``load_adapter`` / ``drop_adapter`` / ``check_adapter``).

    Args:
        model: the vLLM worker's model (vLLM's LoRA manager hangs on it when the engine was
            started with ``enable_lora=True``).
        versions_kept: how many versions of each adapter the manager keeps
            (``CheckpointEngineConfig.adapter_versions``).
    """

    def __init__(self, model: torch.nn.Module, versions_kept: Callable[[], int]) -> None:
        self._model = model
        self._versions_kept = versions_kept
        self._held: dict[tuple[str, int], Any] = {}
        self._retired: dict[int, Any] = {}
        self.next_lora_id: int | None = None
        """The int id the next :meth:`load` gives its version (the actor's choice)."""

    def _manager(self) -> Any:
        manager = lora_manager_of(self._model)
        if manager is None:
            raise WeightSyncError(
                "this vLLM engine runs without LoRA: start it with enable_lora=True, "
                "max_lora_rank at least the adapter's rank and max_cpu_loras at least "
                "(adapter_versions + 1) per adapter name")
        return manager

    def check(self, spec: AdapterSpec) -> None:
        """Refuse an adapter this engine cannot serve: LoRA disabled, a rank above
        ``max_lora_rank``, a target module the model's LoRA layers lack, or more versions
        than ``max_cpu_loras`` holds (every adapter name needs ``adapter_versions + 1``:
        the versions kept, and the next one while it arrives).

        Raises:
            WeightSyncError: saying which limit, and the engine argument to raise.
        """
        limits = lora_limits(self._manager())
        if spec.rank > limits.max_rank:
            raise WeightSyncError(f"its rank {spec.rank} is above vLLM's max_lora_rank "
                                  f"{limits.max_rank}")
        unknown = sorted(set(spec.target_modules) - limits.target_modules)
        if unknown:
            raise WeightSyncError(
                f"vLLM's model has no LoRA layer for target module(s) {unknown} (it takes "
                f"{sorted(limits.target_modules)})")
        names = {name for name, _ in self._held} | {spec.name}
        needed = len(names) * (self._versions_kept() + 1)
        if needed > limits.max_cpu_loras:
            raise WeightSyncError(
                f"{len(names)} adapter name(s) of adapter_versions={self._versions_kept()} "
                f"need {needed} LoRAs held at once (the kept versions and the one "
                f"arriving), but vLLM's max_cpu_loras is {limits.max_cpu_loras}; start vLLM "
                f"with max_cpu_loras >= {needed} (max_loras bounds the adapters of one "
                "batch only)")

    def load(self, spec: AdapterSpec, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Add ``version`` of adapter ``spec.name`` under :attr:`next_lora_id`, all or
        nothing; a version already held is replaced (its old LoRA retired).

        Raises:
            WeightSyncError: no id was given, vLLM holds as many LoRAs as it can, or vLLM
                refused the adapter (nothing was added).
        """
        lora_id, self.next_lora_id = self.next_lora_id, None
        if lora_id is None:
            raise WeightSyncError(
                "an adapter sync reaches a vLLM worker through its rollout actor's "
                "update_weights(adapter=...), which gives the version its LoRA id")
        manager = self._manager()
        limit = lora_limits(manager).max_cpu_loras
        if len(self._held) + len(self._retired) >= limit:
            raise WeightSyncError(
                f"vLLM holds {len(self._held)} adapter version(s) and "
                f"{len(self._retired)} dropped one(s) that requests in flight still use: "
                f"max_cpu_loras={limit} leaves no room for version {version} of "
                f"{spec.name!r}")
        lora = build_lora(manager, lora_id, spec, tensors)
        add_lora(manager, lora)
        replaced = self._held.pop((spec.name, version), None)
        if replaced is not None:
            self._retired[replaced.id] = replaced
        self._held[(spec.name, version)] = lora

    def drop(self, name: str, version: int) -> None:
        """Retire ``version`` of adapter ``name`` (vLLM keeps it until :meth:`release`)."""
        lora = self._held.pop((name, version), None)
        if lora is not None:
            self._retired[lora.id] = lora

    def release(self, lora_ids: list[int]) -> list[int]:
        """Remove from vLLM those of ``lora_ids`` that are retired (the actor knows no
        request in flight uses them); returns the ids still retired."""
        manager = lora_manager_of(self._model)
        for lora_id in lora_ids:
            if self._retired.pop(lora_id, None) is not None and manager is not None:
                remove_lora(manager, lora_id)
        return sorted(self._retired)

    def restore(self) -> None:
        """Add back every LoRA vLLM let go of (vLLM drops them all when it reloads the base
        weights)."""
        manager = lora_manager_of(self._model)
        if manager is None:
            return
        present = loaded_ids(manager)
        for lora in [*self._held.values(), *self._retired.values()]:
            if lora.id not in present:
                add_lora(manager, lora)

    def status(self) -> dict[str, Any]:
        """``{"held": [{"name", "version", "lora_id"}, ...], "retired": [ids]}`` (plain
        data for vLLM's MessagePack)."""
        return {"held": [{"name": name, "version": version, "lora_id": lora.id}
                         for (name, version), lora in self._held.items()],
                "retired": sorted(self._retired)}
