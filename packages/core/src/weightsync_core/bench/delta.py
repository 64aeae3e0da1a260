"""Benchmark: full syncs against delta syncs of the same kind of update, in one run.

One actor rank holds fp32 master weights and sends them in bf16 to one rollout worker. Each
timed step first moves every master weight by the learning rate, up or down (an Adam step's
size), which changes about 2% of the bf16 elements at the default rate. The full syncs
(``delta=False``) and the delta syncs (``delta=True``, after one full sync that gives both
ends a baseline) run one after the other on the same processes; a full sync clears the
baselines, so the two cannot alternate.

Beside them, the encodings delta sync chose between, measured on the first step's update
of the first tensors: changed positions + values (int32 each), a bitmask + values, and an
XOR of old and new bits compressed with zlib (level 1, the compressor in Python's standard
library; zstd and lz4 are not installed here).
"""

from __future__ import annotations

import statistics
import time
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import ray
import torch

from weightsync_core.bench.measure import bench_config, gbps, synthetic_deployment
from weightsync_core.data.delta import encode_patch
from weightsync_core.orchestration.deployment import Placement

__all__ = ["DEFAULT_LEARNING_RATE", "DeltaBenchResult", "EncodingRow", "SyncRow",
           "measure_encodings", "run_delta_benchmark"]

DEFAULT_LEARNING_RATE = 1.6e-5
"""Changes about 2% of the bf16 elements of master weights drawn uniformly from [0, 1)."""
_ENCODING_SAMPLE_BYTES = 64 << 20


@dataclass
class SyncRow:
    """Medians of one kind of sync: ``wire_bytes`` sent, the transfer stage's and the whole
    sync's seconds, the fraction of elements changed, the sender's diffing and the worker's
    applying (seconds)."""

    mode: str
    wire_bytes: float
    transfer_seconds: float
    sync_seconds: float
    changed_fraction: float
    diff_seconds: float
    apply_seconds: float


@dataclass
class EncodingRow:
    """One encoding of the same update: bytes, and the seconds to encode it here."""

    encoding: str
    nbytes: int
    encode_seconds: float


@dataclass
class DeltaBenchResult:
    """Full against delta syncs of ``model_bytes`` (bf16) to one rollout worker."""

    backend: str
    engine_kwargs: dict[str, Any]
    model_bytes: int
    learning_rate: float
    repeats: int
    rows: list[SyncRow] = field(default_factory=list)
    encodings: list[EncodingRow] = field(default_factory=list)
    encoding_sample_bytes: int = 0

    def row(self, mode: str) -> SyncRow:
        """The row of ``mode`` (``full`` or ``delta``)."""
        return next(row for row in self.rows if row.mode == mode)

    def as_dict(self) -> dict[str, Any]:
        """Result with the ratios full / delta of bytes and of sync time."""
        full, delta = self.row("full"), self.row("delta")
        return {**asdict(self), "bytes_ratio": full.wire_bytes / delta.wire_bytes,
                "time_ratio": full.sync_seconds / delta.sync_seconds}

    def table(self) -> str:
        """Human-readable summary."""
        derived = self.as_dict()
        lines = [
            f"{self.model_bytes / 2**30:.2f} GiB of bf16 weights (fp32 masters, each step "
            f"+-{self.learning_rate:g} per element) from 1 actor rank to 1 rollout worker, "
            f"backend {self.backend} {self.engine_kwargs}, median of {self.repeats} steps",
            f"{'sync':6} {'MB sent':>10} {'changed':>8} {'transfer s':>10} {'sync s':>8} "
            f"{'GB/s':>6} {'diff s':>7} {'apply s':>8}",
        ]
        for row in self.rows:
            lines.append(
                f"{row.mode:6} {row.wire_bytes / 1e6:10.1f} {row.changed_fraction:8.2%} "
                f"{row.transfer_seconds:10.3f} {row.sync_seconds:8.3f} "
                f"{gbps(int(self.model_bytes), row.sync_seconds):6.2f} "
                f"{row.diff_seconds:7.3f} {row.apply_seconds:8.3f}")
        lines += [
            f"full / delta: {derived['bytes_ratio']:.1f}x the bytes (goal >= 10x), "
            f"{derived['time_ratio']:.2f}x the sync time",
            f"encodings of one update ({self.encoding_sample_bytes / 2**20:.0f} MiB sample):",
        ]
        sample = self.encoding_sample_bytes
        lines += [f"  {row.encoding:34} {row.nbytes / sample:7.2%} of the bytes, "
                  f"{row.encode_seconds:6.3f} s" for row in self.encodings]
        return "\n".join(lines)


def measure_encodings(old: torch.Tensor, new: torch.Tensor) -> list[EncodingRow]:
    """The encodings of ``old`` -> ``new`` (flat, 16-bit) side by side: what delta sync
    sends (it picks positions or bitmask per tensor, whichever is smaller), each of those
    two, and XOR + zlib. The patch is timed at its second encoding (the first one in a
    process loads the compiled sweep)."""
    encode_patch(new, old.clone())
    baseline = old.clone()
    start = time.perf_counter()
    patch, stats = encode_patch(new, baseline)
    chosen = time.perf_counter() - start
    width = new.element_size()
    start = time.perf_counter()
    xor = (new.view(torch.int16) ^ old.view(torch.int16)).numpy().tobytes()
    compressed = zlib.compress(xor, 1)
    xor_seconds = time.perf_counter() - start
    return [
        EncodingRow(f"delta sync's patch ({stats.kind.name.lower()})", patch.numel(), chosen),
        EncodingRow("positions (int32) + values", stats.changed * (4 + width), chosen),
        EncodingRow("bitmask + values", -(-new.numel() // 8) + stats.changed * width, chosen),
        EncodingRow("XOR + zlib level 1", len(compressed), xor_seconds),
        EncodingRow("whole tensor", new.numel() * width, 0.0),
    ]


def _encoding_sample(learning_rate: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's update of a master tensor, as bf16 before and after."""
    generator = torch.Generator().manual_seed(0)
    masters = torch.rand(_ENCODING_SAMPLE_BYTES // 2, generator=generator)
    before = masters.bfloat16()
    signs = torch.randint(0, 2, masters.shape, generator=generator, dtype=torch.int8)
    masters.add_(signs.float().mul_(2).sub_(1), alpha=learning_rate)
    return before, masters.bfloat16()


def _median_row(mode: str, samples: list[dict[str, float]]) -> SyncRow:
    def median(key: str) -> float:
        return statistics.median(sample.get(key, 0.0) for sample in samples)

    return SyncRow(mode, median("weightsync/bytes"), median("weightsync/seconds/transfer"),
                   median("weightsync/seconds/total"), median("weightsync/changed_fraction"),
                   median("weightsync/seconds/diff"), median("weightsync/seconds/apply"))


def run_delta_benchmark(
    backend: str,
    engine_kwargs: dict[str, Any],
    size_megabytes: int = 1024,
    num_tensors: int = 64,
    repeats: int = 3,
    bucket_megabytes: int = 64,
    learning_rate: float = DEFAULT_LEARNING_RATE,
    placement: Placement | None = None,
) -> DeltaBenchResult:
    """Measure full and delta syncs of ``size_megabytes`` of bf16 weights (fp32 masters of
    twice that) from one actor rank to one rollout worker (placed by ``placement``)."""
    config = replace(bench_config(backend, engine_kwargs, bucket_megabytes),
                     rollout_dtype="bfloat16")
    result = DeltaBenchResult(backend, dict(engine_kwargs), 0, learning_rate, repeats)
    with synthetic_deployment(config, 1, (1,), 2 * size_megabytes << 20, num_tensors,
                              placement) as (deployment, master_bytes):
        result.model_bytes = master_bytes // 2
        [actor] = deployment.actors
        step = 0
        for mode in ("full", "delta"):
            manager = deployment.manager(delta=mode == "delta")
            manager.update_weights_sync(global_steps=step)  # warm-up; the delta baseline
            samples = []
            for _ in range(repeats):
                step += 1
                ray.get(actor.optimizer_step.remote(learning_rate, step))
                samples.append(manager.update_weights_sync(global_steps=step))
            if mode == "full":
                samples = [{**sample, "weightsync/changed_fraction": 1.0} for sample in samples]
            result.rows.append(_median_row(mode, samples))
    before, after = _encoding_sample(learning_rate)
    result.encoding_sample_bytes = before.numel() * before.element_size()
    result.encodings = measure_encodings(before, after)
    return result
