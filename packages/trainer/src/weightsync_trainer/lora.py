"""LoRA in the trainer: the actor's PEFT adapter, and how its parameters are named on the
wire. A PEFT model holds a target module's frozen weight as ``<module>.base_layer.weight``
and the adapter's as ``<module>.lora_A.<adapter>.weight``; syncs name the first as the
checkpoint does (``<module>.weight``) and the second as PEFT's
``get_peft_model_state_dict`` does (``base_model.model.<module>.lora_A.weight``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from weightsync_core import AdapterSpec
from weightsync_trainer.config import ModelConfig

__all__ = [
    "ADAPTER_NAME",
    "adapter_parameters",
    "adapter_spec",
    "base_parameters",
    "lora_config",
    "with_adapter",
]

ADAPTER_NAME = "policy"
"""The name of the actor's adapter in syncs (PEFT's own is ``default``)."""

_PEFT_PREFIX = "base_model.model."
_LORA_PARAMETER = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])\.(?P<adapter>[^.]+)\.weight$")
_LORA_PART = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


def lora_config(model: ModelConfig) -> Any:
    """PEFT's ``LoraConfig`` of ``model`` (``lora_rank`` > 0): ``lora_alpha`` on
    ``target_modules``, no dropout (sampling and training see the same function)."""
    from peft import LoraConfig

    return LoraConfig(r=model.lora_rank, lora_alpha=model.lora_alpha,
                      target_modules=list(model.target_modules), lora_dropout=0.0)


def adapter_spec(model: ModelConfig) -> AdapterSpec:
    """The actor's adapter as syncs describe it."""
    return AdapterSpec(ADAPTER_NAME, model.lora_rank, model.lora_alpha,
                       tuple(model.target_modules))


def with_adapter(model: torch.nn.Module, config: ModelConfig) -> torch.nn.Module:
    """``model`` with a fresh trainable LoRA adapter (PEFT's ``get_peft_model``; its base
    weights frozen); ``model`` itself where ``lora_rank`` is 0."""
    if not config.lora_rank:
        return model
    from peft import get_peft_model

    torch.manual_seed(config.seed + 2)  # every actor rank starts from the same adapter
    return get_peft_model(model, lora_config(config))  # pyright: ignore[reportArgumentType]


def base_parameters(named: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's parameters of a model PEFT may have adapted, under their checkpoint
    names (PEFT's wrapper prefix and ``base_layer`` dropped, adapter parameters left out);
    any other model's as they are."""
    for name, tensor in named:
        if _LORA_PART.search(name):
            continue
        yield name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", "."), tensor


def adapter_parameters(named: Iterable[tuple[str, torch.Tensor]], adapter: str = "default"
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Adapter ``adapter``'s ``lora_A``/``lora_B`` parameters of a PEFT model, under the
    names PEFT's ``get_peft_model_state_dict`` gives them."""
    for name, tensor in named:
        match = _LORA_PARAMETER.match(name)
        if match is not None and match["adapter"] == adapter:
            yield f"{match['module']}.lora_{match['side']}.weight", tensor
