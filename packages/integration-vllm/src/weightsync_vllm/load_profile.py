"""``weightsync-vllm-load-profile``: where vLLM spends a weightsync load, profiled in one
process.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The bench's Qwen2 of
``--size-mb`` is loaded the way weightsync's engine loads a sync (the layerwise reload
started, one ``load_weights`` call per tensor, the reload finished), first timed, then under
``cProfile``; the functions taking the most time are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from weightsync_vllm.bench import model_shape
from weightsync_vllm.model_source import save_qwen2
from weightsync_vllm.reload import finish_reload, start_reload
from weightsync_vllm.rollout_worker_base import default_engine_args

__all__ = ["load_once", "main"]


def load_once(model: Any, model_config: Any, weights: dict[str, torch.Tensor]) -> float:
    """Load ``weights`` into ``model`` as weightsync's engine does; returns the seconds."""
    start = time.perf_counter()
    start_reload(model)
    for item in weights.items():
        model.load_weights([item])
    finish_reload(model, model_config)
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        description="Where vLLM spends a weightsync load, profiled in one process.")
    parser.add_argument("--size-mb", type=int, default=400,
                        help="float32 MiB of the Qwen2 (as weightsync-vllm-bench builds it)")
    parser.add_argument("--repeats", type=int, default=3, help="timed loads before the profile")
    parser.add_argument("--top", type=int, default=25, help="functions to print")
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM  # after the environment is set: vLLM reads it at import

    with tempfile.TemporaryDirectory() as directory:
        path = save_qwen2(str(Path(directory) / "model"), **model_shape(args.size_mb))
        llm = LLM(**default_engine_args(path), max_model_len=256)
        weights: dict[str, torch.Tensor] = {}
        for shard in sorted(Path(path).glob("*.safetensors")):
            weights.update(load_file(shard))
    # vLLM types the client as any engine-core client; in-process it is the one holding
    # the engine core, whose uniproc executor holds the model runner
    client: Any = llm.llm_engine.engine_core
    runner = client.engine_core.model_executor.driver_worker.worker.model_runner
    model, model_config = runner.model, runner.model_config
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    print(f"{len(weights)} tensors, {nbytes / (1 << 20):.0f} MiB")
    for _ in range(args.repeats):
        print(f"load: {load_once(model, model_config, weights):.3f} s")
    profile = cProfile.Profile()
    profile.runcall(load_once, model, model_config, weights)
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
