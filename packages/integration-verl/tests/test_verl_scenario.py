"""verl's CPU checkpoint-engine scenario (verl 0.9.1 tests/checkpoint_engine/
test_correctness_on_gpu.py::test_nixl_checkpoint_engine with device="cpu", and its
test_utils.py), on weightsync backends registered through ``custom_backend_module``: 2
trainer ranks, 6 rollout workers in replicas of 2, three updates, every weight checked
against the trainer's; driven by verl's own ``CheckpointEngineManager`` and by weightsync's
through ``checkpoint_manager_class``, on the same workers."""

from __future__ import annotations

import asyncio

import pytest
import torch
from verl.utils.kernel.fp8_kernel import _scaled_fp8_blockwise_pytorch
from verl.workers.config import CheckpointEngineConfig

from weightsync_core.data.quantization import dequantize_fp8_block, quantize_fp8_block
from weightsync_verl import CheckpointEngineManager
from weightsync_verl.engines import weightsync_backend_name
from weightsync_verl.scenario import make_cluster, make_manager

BACKENDS = ["gloo", "nixl", "mooncake", "kimi"]
WEIGHTSYNC_MANAGER = "weightsync_verl.CheckpointEngineManager"


def _config(backend: str, delta: bool = False, **options: object) -> CheckpointEngineConfig:
    name = f"weightsync_{backend}"
    options = {"timeout": 60, **({"delta": True} if delta else {}), **options}
    return CheckpointEngineConfig(
        backend=name, update_weights_bucket_megabytes=1,
        engine_kwargs={name: options}, custom_backend_module="weightsync_verl",
    )


def _check(cluster, expected: dict[str, str], step: int) -> None:
    reports = cluster.reports()
    assert len(reports) == 6
    for worker, report in enumerate(reports):
        assert report["received"] == expected, f"rollout worker {worker} got other weights"
        assert report["global_steps"][-1] == step


@pytest.fixture(scope="module")
def workers(ray_cluster, model_path):
    """One set of verl workers for every backend (starting 8 workers takes most of a minute
    on 2 cores); each backend gets engines built anew, as a fresh start would."""
    cluster = make_cluster(_config(BACKENDS[0]), model_path)
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request, workers):
    workers.use_backend(_config(request.param))
    return workers


def test_verls_manager_moves_three_updates_bit_exact(cluster) -> None:
    manager = make_manager(cluster)

    async def train() -> None:
        for step in (1, 2, 3):
            expected = cluster.perturb(step)
            metrics = await manager.update_weights(global_steps=step)
            _check(cluster, expected, step)
            # verl's manager merges the trainer ranks' metrics: rank 1 only iterated
            assert metrics["weightsync/bytes"] == cluster.nbytes()
            assert metrics["weightsync/tensors"] == len(expected)

    asyncio.run(train())


def test_weightsyncs_manager_moves_three_updates_from_synchronous_code(cluster) -> None:
    # as verl's trainer: checkpoint_manager.update_weights(self.global_steps), no await
    manager = make_manager(cluster, WEIGHTSYNC_MANAGER)
    assert isinstance(manager, CheckpointEngineManager)
    manager.sleep_replicas()  # verl's trainer does this right after building the manager
    for step in (11, 12, 13):
        expected = cluster.perturb(step)
        metrics = manager.update_weights(step)
        assert metrics["weightsync/tensors"] == len(expected)
        assert metrics["weightsync/replicas"] == 3
        _check(cluster, expected, step)
    assert manager.stale_replicas == []


def test_weightsyncs_manager_removes_and_adds_a_replica(cluster) -> None:
    manager = make_manager(cluster, WEIGHTSYNC_MANAGER)
    left = cluster.replicas[-1]
    manager.remove_replicas([left])
    expected = cluster.perturb(21)
    manager.update_weights(21)
    reports = cluster.reports()
    assert all(report["received"] == expected for report in reports[:4])
    assert all(report["global_steps"][-1] != 21 for report in reports[4:])
    manager.add_replicas([left])
    expected = cluster.perturb(22)
    manager.update_weights(22)
    _check(cluster, expected, 22)



def test_verls_manager_moves_delta_syncs_bit_exact(cluster) -> None:
    """Delta sync inside verl's own manager (``engine_kwargs: {weightsync_X: {delta:
    true}}``): the processes agree the plan through prepare() and build_topology; the first
    sync is full, the next two send patches of the 2% that changed, the fourth is full
    (``full_verify_every: 3``); every weight checked."""
    backend = weightsync_backend_name(cluster.config.backend)
    cluster.use_backend(_config(backend, delta=True, full_verify_every=3))
    manager = make_manager(cluster)

    async def train() -> None:
        # the first sync is full, then patches; every 3rd sync is full again
        for step, delta in ((31, False), (32, True), (33, True), (34, False)):
            expected = cluster.perturb(step, fraction=0.02)
            metrics = await manager.update_weights(global_steps=step)
            _check(cluster, expected, step)
            assert metrics["weightsync/delta"] == float(delta), (step, metrics)
            if delta:  # kimi: what the last actor rank's share sent
                sent = metrics.get("weightsync/bytes", metrics.get("weightsync/share_bytes"))
                assert sent < cluster.nbytes() / 5, metrics
            # each of the 2 trainer ranks keeps its slice (or kimi's share) of the version
            kept = cluster.delta_kept_bytes()
            assert all(0 < size < cluster.nbytes() * 0.75 for size in kept), kept

    try:
        asyncio.run(train())
    finally:
        cluster.use_backend(_config(backend))


def test_verls_manager_moves_fp8_syncs_which_verls_fp8_rollout_quantizes_to_the_same_bytes(
        workers) -> None:
    """``rollout_quantization: fp8_block`` in the engine kwargs: each linear weight travels
    as float8 with its block scales (the bytes counted), every rollout worker hands verl's
    server the weights dequantized to bf16 (as verl's servers load them), two syncs; verl's
    own FP8 quantizer (what its vLLM worker runs on them under ``rollout.quantization:
    fp8``) turns them back into the very float8 bytes that travelled."""
    workers.use_backend(_config("gloo", rollout_quantization="fp8_block",
                                rollout_dtype="bfloat16"))
    manager = make_manager(workers)

    async def train() -> None:
        for step in (41, 42):
            workers.perturb(step)
            metrics = await manager.update_weights(global_steps=step)
            quantized = workers.quantized("bfloat16")
            _check(workers, quantized["digests"], step)
            assert metrics["weightsync/bytes"] == quantized["nbytes"]
            # fewer than bf16's (this tiny model is mostly its bf16 embeddings)
            assert quantized["nbytes"] < workers.nbytes() / 2

    try:
        asyncio.run(train())
    finally:
        workers.use_backend(_config(BACKENDS[0]))


def test_verls_fp8_quantizer_turns_the_delivered_weights_back_into_the_sent_bytes() -> None:
    generator = torch.Generator().manual_seed(7)
    for shape in ((300, 260), (1024, 512), (128, 4096)):
        weight = torch.randn(*shape, generator=generator) * torch.logspace(-4, 1, shape[1])
        sent, scales = quantize_fp8_block(weight)
        delivered = dequantize_fp8_block(sent, scales, torch.bfloat16)
        requantized, verl_scales = _scaled_fp8_blockwise_pytorch(delivered, [128, 128])
        assert torch.equal(requantized.view(torch.uint8), sent.view(torch.uint8)), shape
        # verl's scale of the bf16 values: the same within bf16's rounding of the amax
        assert torch.allclose(verl_scales.squeeze(-1), scales, rtol=2**-7, atol=0.0)

