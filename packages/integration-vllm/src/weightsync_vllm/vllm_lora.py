"""The vLLM internals through which weightsync serves LoRA adapters it received in memory.

vLLM's own way to serve an adapter (a ``LoRARequest`` naming a directory) reads the adapter
from disk in the worker at the first request that names it. weightsync builds the adapter
from the received tensors and adds it to the worker's LoRA model manager itself, so a
request finds it loaded. These are internal APIs of vLLM 0.32 (``vllm/lora/lora_model.py``
``LoRAModel.from_lora_tensors``, ``vllm/lora/peft_helper.py`` ``PEFTHelper``,
``vllm/lora/model_manager.py`` ``LRUCacheLoRAModelManager`` and the model's
``lora_manager`` attribute it sets): this module is the only one that touches them, and
``tests/test_lora_replica.py`` pins them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from weightsync_core import AdapterSpec

__all__ = [
    "LoRALimits",
    "add_lora",
    "build_lora",
    "loaded_ids",
    "lora_limits",
    "lora_manager_of",
    "remove_lora",
]


@dataclass(frozen=True)
class LoRALimits:
    """What a vLLM engine's LoRA configuration admits."""

    max_rank: int
    """``max_lora_rank``."""
    max_loras: int
    """``max_loras``: adapters one batch may use."""
    max_cpu_loras: int
    """``max_cpu_loras``: adapters the worker holds (beyond it vLLM evicts the least
    recently used one, which weightsync never lets happen)."""
    target_modules: frozenset[str]
    """The module names an adapter may target (packed modules by their parts: ``q_proj``,
    ``k_proj``, ``v_proj`` for ``qkv_proj``)."""


def lora_manager_of(model: torch.nn.Module) -> Any | None:
    """The LoRA model manager of a vLLM model (None: the engine runs without
    ``enable_lora``); vLLM's manager sets itself as the model's ``lora_manager``."""
    return getattr(model, "lora_manager", None)


def lora_limits(manager: Any) -> LoRALimits:
    """The limits of the engine whose LoRA model manager is ``manager``."""
    config = manager.lora_config
    packed = manager.packed_modules_mapping
    targets: set[str] = set()
    for module in manager.supported_lora_modules:
        targets.update(packed.get(module, [module]))
    return LoRALimits(int(config.max_lora_rank), int(config.max_loras),
                      int(config.max_cpu_loras), frozenset(targets))


def build_lora(manager: Any, lora_id: int, spec: AdapterSpec,
               tensors: dict[str, torch.Tensor]) -> Any:
    """vLLM's ``LoRAModel`` of ``spec`` under int id ``lora_id`` from PEFT-named
    ``tensors`` (copied: vLLM scales ``lora_B`` in place), checked as vLLM checks an adapter
    it loads from disk (``PEFTHelper.validate_legal``: the rank against
    ``max_lora_rank``)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    peft = PEFTHelper.from_dict({"r": spec.rank, "lora_alpha": spec.alpha,
                                 "target_modules": list(spec.target_modules)})
    peft.validate_legal(manager.lora_config)
    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    dtype = manager.lora_config.lora_dtype
    return LoRAModel.from_lora_tensors(
        lora_model_id=lora_id,
        tensors={name: tensor.to(dtype=dtype, copy=True) for name, tensor in tensors.items()},
        peft_helper=peft, device="cpu", dtype=dtype,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )


def add_lora(manager: Any, lora: Any) -> None:
    """Register ``lora`` with the manager and activate it (which copies its tensors into
    the LoRA layers, so that a tensor that does not fit the model is refused here rather
    than at a request); all or nothing."""
    manager.add_adapter(lora)
    try:
        manager.activate_adapter(lora.id)
    except BaseException:
        manager.remove_adapter(lora.id)
        raise


def remove_lora(manager: Any, lora_id: int) -> None:
    """Deactivate and unregister adapter ``lora_id`` (nothing where it is not held)."""
    manager.remove_adapter(lora_id)


def loaded_ids(manager: Any) -> set[int]:
    """The int ids of the adapters the manager holds."""
    return set(manager.list_adapters())
