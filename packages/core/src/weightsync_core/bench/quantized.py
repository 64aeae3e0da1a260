"""Benchmark: syncs of bf16 weights against the same weights quantized on send
(``rollout_quantization="fp8_block"``), in one run.

One actor rank holds fp32 master weights as matrices (a linear layer's) and sends them to one
rollout worker: in bf16, then block-FP8 (the float8 bytes and their scales), then FP8 delta
syncs after each optimizer step (the fraction of FP8 elements that change per step: a step
that moves a block's largest value changes its scale and so every element of the block).
Each mode runs on processes of its own (the quantization is a setting every process is built
with). Beside them, what quantizing costs here: seconds per GiB of fp32 and of bf16 weights.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import ray
import torch

from weightsync_core.bench.measure import bench_config, synthetic_deployment
from weightsync_core.data.quantization import quantize_fp8_block
from weightsync_core.orchestration.deployment import Placement

__all__ = ["QuantizedBenchResult", "QuantizedRow", "quantize_seconds_per_gib",
           "run_quantized_benchmark"]

_COLUMNS = 4096
"""Columns of each weight matrix (a 4096-wide model's layers)."""
_MODES = (("bf16", None, False), ("fp8_block", "fp8_block", False),
          ("fp8_block delta", "fp8_block", True))


@dataclass
class QuantizedRow:
    """Medians of one mode: bytes sent, the transfer stage's and the whole sync's seconds,
    and the fraction of the travelling elements that changed (1 for full syncs)."""

    mode: str
    wire_bytes: float
    transfer_seconds: float
    sync_seconds: float
    changed_fraction: float


@dataclass
class QuantizedBenchResult:
    """bf16 against fp8_block syncs of ``master_bytes`` of fp32 masters to one worker."""

    backend: str
    engine_kwargs: dict[str, Any]
    master_bytes: int
    learning_rate: float
    repeats: int
    rows: list[QuantizedRow] = field(default_factory=list)
    quantize_seconds_per_gib: dict[str, float] = field(default_factory=dict)

    def row(self, mode: str) -> QuantizedRow:
        """The row of ``mode``."""
        return next(row for row in self.rows if row.mode == mode)

    def as_dict(self) -> dict[str, Any]:
        """Result with the ratios bf16 / fp8_block of bytes and of sync time."""
        bf16, fp8 = self.row("bf16"), self.row("fp8_block")
        return {**asdict(self), "bytes_ratio": bf16.wire_bytes / fp8.wire_bytes,
                "time_ratio": bf16.sync_seconds / fp8.sync_seconds}

    def table(self) -> str:
        """Human-readable summary."""
        derived = self.as_dict()
        lines = [
            f"{self.master_bytes / 2**30:.2f} GiB of fp32 masters ({_COLUMNS}-column "
            f"matrices) from 1 actor rank to 1 rollout worker, backend {self.backend} "
            f"{self.engine_kwargs}, median of {self.repeats} syncs",
            f"{'mode':16} {'MB sent':>10} {'changed':>8} {'transfer s':>10} {'sync s':>8}",
        ]
        lines += [f"{row.mode:16} {row.wire_bytes / 1e6:10.1f} {row.changed_fraction:8.2%} "
                  f"{row.transfer_seconds:10.3f} {row.sync_seconds:8.3f}" for row in self.rows]
        lines.append(f"bf16 / fp8_block: {derived['bytes_ratio']:.2f}x the bytes, "
                     f"{derived['time_ratio']:.2f}x the sync time")
        lines += [f"quantizing {dtype} weights here: {seconds:.3f} s per GiB of them"
                  for dtype, seconds in self.quantize_seconds_per_gib.items()]
        return "\n".join(lines)


def quantize_seconds_per_gib(dtype: torch.dtype, megabytes: int = 256) -> float:
    """Seconds :func:`quantize_fp8_block` takes per GiB of ``dtype`` weights, in this
    process (median of 3 over a ``megabytes`` matrix)."""
    columns = _COLUMNS
    rows = (megabytes << 20) // dtype.itemsize // columns
    weight = torch.rand(rows, columns).to(dtype)
    quantize_fp8_block(weight[:128])  # first call: torch's kernels warmed
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        quantize_fp8_block(weight)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * (1 << 30) / (weight.numel() * dtype.itemsize)


def run_quantized_benchmark(
    backend: str,
    engine_kwargs: dict[str, Any],
    size_megabytes: int = 1024,
    num_tensors: int = 32,
    repeats: int = 3,
    bucket_megabytes: int = 64,
    learning_rate: float = 1.6e-5,
    placement: Placement | None = None,
) -> QuantizedBenchResult:
    """Measure bf16, fp8_block and fp8_block delta syncs of ``size_megabytes`` of fp32
    masters (each mode on processes of its own, placed by ``placement``: say, the actor
    rank on one testbed host and the worker on another) and the cost of quantizing here."""
    base = replace(bench_config(backend, engine_kwargs, bucket_megabytes),
                   rollout_dtype="bfloat16")
    result = QuantizedBenchResult(backend, dict(engine_kwargs), 0, learning_rate, repeats)
    for mode, quantization, delta in _MODES:
        config = replace(base, rollout_quantization=quantization, delta=delta)
        with synthetic_deployment(config, 1, (1,), size_megabytes << 20, num_tensors,
                                  placement, columns=_COLUMNS) as (deployment, master_bytes):
            result.master_bytes = master_bytes
            [actor] = deployment.actors
            manager = deployment.manager()
            manager.update_weights_sync(global_steps=0)  # warm-up; a delta's baseline
            samples = []
            for step in range(1, repeats + 1):
                ray.get(actor.optimizer_step.remote(learning_rate, step))
                samples.append(manager.update_weights_sync(global_steps=step))
        result.rows.append(_median_row(mode, samples, delta))
    result.quantize_seconds_per_gib = {
        str(dtype).removeprefix("torch."): quantize_seconds_per_gib(dtype)
        for dtype in (torch.float32, torch.bfloat16)}
    return result


def _median_row(mode: str, samples: list[dict[str, float]], delta: bool) -> QuantizedRow:
    def median(key: str, default: float = 0.0) -> float:
        return statistics.median(sample.get(key, default) for sample in samples)

    return QuantizedRow(mode, median("weightsync/bytes"),
                        median("weightsync/seconds/transfer"),
                        median("weightsync/seconds/total"),
                        median("weightsync/changed_fraction") if delta else 1.0)
