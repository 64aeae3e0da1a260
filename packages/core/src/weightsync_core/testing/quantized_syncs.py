"""Syncs quantized on send (``rollout_quantization="fp8_block"``) through a backend: ten delta
syncs in a row of a decoder's weights whose changes are none, all, one element and 2%, every
receiver checked bit-exact against the quantized stream (float8 bytes and scales) each time.
A backend's tests build a :class:`~weightsync_core.testing.SyncHarness` from
:func:`quantized_config` and call :func:`check_quantized_delta_syncs`."""

from __future__ import annotations

from typing import Any

import torch

from weightsync_core.api.config import CheckpointEngineConfig
from weightsync_core.data.quantization import QuantizedWeights
from weightsync_core.testing.harness import SyncHarness
from weightsync_core.testing.weights import (
    ONE_ELEMENT,
    TensorDigest,
    digests,
    make_weights,
    sparse_updates,
)

__all__ = ["QUANTIZED_CHANGES", "check_quantized_delta_syncs", "expected_quantized",
           "quantized_config"]

QUANTIZED_CHANGES: list[list[tuple[int, float]]] = [
    [], [], [(1, 1.0)], [(2, ONE_ELEMENT)], [(3, 0.02)], [(4, 0.02)], [], [(5, 1.0)],
    [(6, ONE_ELEMENT)], [(7, 0.02)]]
"""What changes before each of the ten syncs (seed, fraction of elements): none, all, one
element, 2%."""
_SEED = 11


def quantized_config(backend: str, **fields: Any) -> CheckpointEngineConfig:
    """1 MiB buckets, bfloat16 for what stays unquantized, fp8_block, delta on."""
    return CheckpointEngineConfig(**{
        "backend": backend, "update_weights_bucket_megabytes": 1,
        "rollout_dtype": "bfloat16", "rollout_quantization": "fp8_block", "delta": True,
        "sync_timeout_seconds": 60, **fields})


def expected_quantized(weights: dict[str, torch.Tensor], rollout_dtype: torch.dtype | None
                       ) -> dict[str, TensorDigest]:
    """The digests a receiver must report: ``weights`` as they travel quantized."""
    return digests(dict(QuantizedWeights(weights, rollout_dtype)))


def check_quantized_delta_syncs(harness: SyncHarness) -> list[dict[str, float]]:
    """Ten syncs of the ``decoder`` weights changed as :data:`QUANTIZED_CHANGES` says, delta
    after the first; every receiver bit-exact after each. Returns each sync's metrics."""
    manager = harness.manager()
    dtype = harness.config.rollout_torch_dtype
    updates: list[tuple[int, float]] = []
    metrics = []
    for step, change in enumerate(QUANTIZED_CHANGES):
        updates += change
        harness.set_weights(_SEED, "decoder", updates=updates)
        result = manager.update_weights_sync(global_steps=step)
        assert result["weightsync/delta"] == (0.0 if step == 0 else 1.0), (step, result)
        if step and not change:
            assert result["weightsync/changed_fraction"] == 0.0, (step, result)
        weights = sparse_updates(
            make_weights(_SEED, harness.config.bucket_size_bytes, "decoder"), updates)
        expected = expected_quantized(weights, dtype)
        for report in harness.reports():
            assert report["received"] == expected, step
        metrics.append(result)
    return metrics
