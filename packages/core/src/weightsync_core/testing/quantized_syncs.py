"""Syncs quantized on send (``rollout_quantization="fp8_block"``) through a backend: ten delta
syncs in a row of a decoder's weights whose changes are none, all, one element and 2%, every
receiver checked bit-exact against the quantized stream (float8 bytes and scales) each time.
A backend's tests build a :class:`~weightsync_core.testing.SyncHarness` from
:func:`quantized_config` and call :func:`check_quantized_delta_syncs`; a backend that
delivers layouts, :func:`check_sharded_quantized_delta_syncs` (FSDP rows on the actor ranks,
a whole and a tensor-parallel replica, every worker bit-exact on its slices of the whole
weights quantized at once)."""

from __future__ import annotations

from typing import Any

import ray
import torch

from weightsync_core.api.config import CheckpointEngineConfig
from weightsync_core.data.quantization import QuantizedWeights
from weightsync_core.data.shards.experts import per_expert_stream
from weightsync_core.data.shards.specs import (
    fsdp_spec,
    moe_spec,
    resolve_layout,
    tensor_parallel_spec,
)
from weightsync_core.testing.harness import SyncHarness
from weightsync_core.testing.weights import (
    DECODER_BLOCKS,
    MOE,
    ONE_ELEMENT,
    TensorDigest,
    digest,
    digests,
    make_weights,
    sparse_updates,
)

__all__ = ["QUANTIZED_CHANGES", "check_quantized_delta_syncs",
           "check_sharded_quantized_delta_syncs", "expected_quantized", "quantized_config"]

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


def check_quantized_delta_syncs(harness: SyncHarness, profile: str = "decoder",
                                layouts: list[Any] | None = None) -> list[dict[str, float]]:
    """Ten syncs of the ``profile`` weights changed as :data:`QUANTIZED_CHANGES` says, delta
    after the first; every receiver bit-exact after each (``layouts``: each worker's
    :data:`~weightsync_core.data.shards.LayoutSpec`, its slices of the whole weights
    quantized at once; None: every worker whole). Returns each sync's metrics."""
    manager = harness.manager()
    dtype = harness.config.rollout_torch_dtype
    updates: list[tuple[int, float]] = []
    metrics = []
    for step, change in enumerate(QUANTIZED_CHANGES):
        updates += change
        harness.set_weights(_SEED, profile, updates=updates)
        result = manager.update_weights_sync(global_steps=step, allow_manifest_change=step == 0)
        assert result["weightsync/delta"] == (0.0 if step == 0 else 1.0), (step, result)
        if step and not change:
            assert result["weightsync/changed_fraction"] == 0.0, (step, result)
        weights = dict(per_expert_stream(sparse_updates(
            make_weights(_SEED, harness.config.bucket_size_bytes, profile), updates).items()))
        expected = _expected_slices(dict(QuantizedWeights(weights, dtype)), layouts,
                                    len(harness.reports()))
        for rank, (report, wanted) in enumerate(zip(harness.reports(), expected, strict=True)):
            differing = [name for name in wanted if report["received"].get(name) != wanted[name]]
            assert report["received"] == wanted, (step, rank, differing[:5])
        metrics.append(result)
    return metrics


def _expected_slices(travelling: dict[str, torch.Tensor], layouts: list[Any] | None,
                     workers: int) -> list[dict[str, TensorDigest]]:
    """The digests each of ``workers`` must report: its boxes (``layouts``) of the tensors
    as they travel whole."""
    shapes = {name: tuple(tensor.shape) for name, tensor in travelling.items()}
    expected = []
    for rank in range(workers):
        spec = None if layouts is None else layouts[rank]
        layout = resolve_layout(spec, shapes, f"rollout rank {rank}")
        expected.append({name: digest(box.cut(travelling[name]).contiguous())
                         for name, box in layout.boxes.items()})
    return expected


def check_sharded_quantized_delta_syncs(harness: SyncHarness, experts: str | None = None
                                        ) -> list[dict[str, float]]:
    """:func:`check_quantized_delta_syncs` through a backend that delivers layouts: the
    actor ranks hold FSDP rows, a replica of one worker takes the whole model, one of two
    splits it; every worker bit-exact on its slices and their scales after each sync. The
    harness's replicas must be of 1 and 2 workers.

    Of the ``decoder_blocks`` weights (blocks whose rows FSDP splits between ranks, slices
    that cut blocks) into a tensor-parallel replica; with ``experts`` (``"tensor"`` or
    ``"expert"``), of the ``moe_fused`` weights (the actor ranks' FSDP rows of the fused
    experts, streamed per expert) into a replica that splits every expert, or the experts
    between its workers."""
    sizes = [len(replica.workers) for replica in harness.replicas]
    assert sorted(sizes) == [1, 2], f"replicas of 1 and 2 workers, got {sizes}"
    workers = [worker for replica in harness.replicas for worker in replica.workers]
    layouts = [None if len(replica.workers) == 1 else
               tensor_parallel_spec(DECODER_BLOCKS, len(replica.workers), rank)
               if experts is None else
               moe_spec(MOE, len(replica.workers), rank, expert_parallel=experts == "expert")
               for replica in harness.replicas for rank in range(len(replica.workers))]
    ranks = len(harness.actors)
    ray.get([actor.set_layout.remote(fsdp_spec(ranks, rank, fused_experts=experts is not None))
             for rank, actor in enumerate(harness.actors)])
    ray.get([worker.set_layout.remote(layout)
             for worker, layout in zip(workers, layouts, strict=True)])
    try:
        return check_quantized_delta_syncs(
            harness, "decoder_blocks" if experts is None else "moe_fused", layouts)
    finally:
        ray.get([actor.set_layout.remote(None) for actor in harness.actors])
        ray.get([worker.set_layout.remote(None) for worker in workers])
