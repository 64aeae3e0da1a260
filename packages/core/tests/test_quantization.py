"""Quantize on send (``rollout_quantization="fp8_block"``): the package's quantizer against a
reference written here from the format's definition (float8_e4m3fn's values enumerated from
its bit layout, nearest value with ties to an even mantissa, numpy float32 arithmetic), the
tensors it leaves alone, and whole syncs over gloo (full and delta) whose receivers get
exactly the reference's bytes and scales."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import ray
import torch

from weightsync_core.api.errors import SyncStageError, TransferError
from weightsync_core.data.quantization import (
    QuantizedWeights,
    block_amax,
    dequantize_fp8_block,
    quantize_fp8_block,
    quantizes,
    scales_of,
)
from weightsync_core.data.shards import Box, fsdp_spec, resolve_layout, tensor_parallel_spec
from weightsync_core.data.shards.quantized import (
    amax_frame_bytes,
    open_amax,
    seal_amax,
    travel_weights,
)
from weightsync_core.net.wire import MessageSealer
from weightsync_core.testing import SyncHarness
from weightsync_core.testing.quantized_syncs import (
    QUANTIZED_CHANGES,
    check_quantized_delta_syncs,
    check_sharded_quantized_delta_syncs,
    quantized_config,
)
from weightsync_core.testing.weights import (
    DECODER_BLOCKS,
    Faults,
    digest,
    digests,
    make_weights,
    sparse_updates,
)


def _e4m3fn_values() -> tuple[np.ndarray, np.ndarray]:
    """Every finite non-negative float8_e4m3fn value (ascending) and its bit pattern: sign 1
    bit, exponent 4 (bias 7), mantissa 3; exponent 0 is subnormal (m/8 * 2^-6); the pattern
    with every exponent and mantissa bit set is NaN (no infinities)."""
    values, codes = [], []
    for code in range(0x7F):  # 0x7F: NaN
        exponent, mantissa = code >> 3, code & 7
        value = (mantissa / 8 * 2.0**-6 if exponent == 0
                 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
        values.append(value)
        codes.append(code)
    return np.array(values, dtype=np.float64), np.array(codes, dtype=np.uint8)


_VALUES, _CODES = _e4m3fn_values()


def _round_to_e4m3fn(x: np.ndarray) -> np.ndarray:
    """The bit patterns of ``x`` (float32, within +-448) rounded to the nearest value, a tie
    to the even pattern."""
    magnitude = np.abs(x.astype(np.float64))
    upper = np.searchsorted(_VALUES, magnitude).clip(1, len(_VALUES) - 1)
    low, high = _VALUES[upper - 1], _VALUES[upper]
    to_high = (high - magnitude < magnitude - low) | (
        (high - magnitude == magnitude - low) & (_CODES[upper] % 2 == 0))
    codes = np.where(to_high, _CODES[upper], _CODES[upper - 1])
    return codes | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)


def reference_fp8_block(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Block by block, as the format says: scale = max(amax, 1e-4) / 448 in float32, each
    element x / scale in float32, clamped to +-448 and rounded."""
    x = weight.float().numpy()
    rows, columns = x.shape
    row_blocks, column_blocks = -(-rows // 128), -(-columns // 128)
    codes = np.zeros((rows, columns), dtype=np.uint8)
    scales = np.zeros((row_blocks, column_blocks), dtype=np.float32)
    for i in range(row_blocks):
        for j in range(column_blocks):
            block = x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = np.float32(np.abs(block).max())
            scale = np.float32(np.maximum(amax, np.float32(1e-4)) / np.float32(448))
            scaled = np.clip(block / scale, np.float32(-448), np.float32(448))
            codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = _round_to_e4m3fn(scaled)
            scales[i, j] = scale
    return codes, scales


def test_the_reference_rounds_like_the_definition():
    # exact values, ties to even, subnormals, the largest value, signs
    x = np.array([0.0, 17.0, 19.0, 448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, -1.125, -17.0],
                 dtype=np.float32)
    expected = [0.0, 16.0, 20.0, 448.0, 2.0**-9, 0.0, 2 * 2.0**-9, -1.125, -16.0]
    codes = _round_to_e4m3fn(x)
    signs = np.where(codes & 0x80, -1.0, 1.0)
    assert list(signs * _VALUES[np.searchsorted(_CODES, codes & 0x7F)]) == expected


def _weight(rows: int, columns: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator) * torch.logspace(
        -6, 3, columns).float()  # blocks of very different magnitudes
    weight[: min(rows, 128), : min(columns, 128)] = 0.0  # an all-zero block
    weight[-1, -1] = 1e4  # past what float8 holds, before scaling
    return weight.to(dtype)


@pytest.mark.parametrize("shape", [(128, 128), (300, 200), (1, 5), (257, 129), (64, 1000),
                                   (9000, 130)])  # the last: several steps of the quantizer
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_block_bytes_and_scales_equal_the_reference(shape, dtype):
    weight = _weight(*shape, seed=sum(shape), dtype=dtype)
    quantized, scale_inv = quantize_fp8_block(weight)
    codes, scales = reference_fp8_block(weight)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == weight.shape
    assert scale_inv.dtype == torch.float32
    assert np.array_equal(quantized.view(torch.uint8).numpy(), codes)
    assert np.array_equal(scale_inv.numpy(), scales)


def test_dequantized_is_each_value_times_its_blocks_scale():
    weight = _weight(300, 200, seed=3, dtype=torch.float32)
    quantized, scale_inv = quantize_fp8_block(weight)
    restored = dequantize_fp8_block(quantized, scale_inv, torch.float32)
    codes, scales = reference_fp8_block(weight)
    signs = np.where(codes & 0x80, -1.0, 1.0)
    values = signs * _VALUES[np.searchsorted(_CODES, codes & 0x7F)]
    expected = values * np.repeat(np.repeat(scales, 128, 0), 128, 1)[:300, :200]
    assert np.array_equal(restored.numpy(), expected.astype(np.float32))
    assert (restored - weight).abs().max() <= weight.abs().max() / 16  # within fp8's step
    with pytest.raises(ValueError, match="300x200 fp8_block weight has 3x2 block scales"):
        dequantize_fp8_block(quantized, scale_inv[:, :1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_quantized_with_agreed_scales_are_the_whole_weight_quantized(dtype):
    # FSDP-like rows of 107 (blocks span ranks) and tensor-parallel columns of 130 (pieces
    # cut blocks): each piece's block amax, the maximum over the pieces, then each piece
    # quantized with the scales of the blocks it touches: the reference's bytes and scales
    weight = _weight(300, 260, seed=5, dtype=dtype)
    codes, scales = reference_fp8_block(weight)
    rows, columns = [(0, 107), (107, 214), (214, 300)], [(0, 130), (130, 260)]
    amax = torch.zeros(3, 3)
    for r0, r1 in rows:
        for c0, c1 in columns:
            touched = Box(((r0 // 128, -(-r1 // 128)), (c0 // 128, -(-c1 // 128))))
            part = block_amax(weight[r0:r1, c0:c1], (r0, c0))
            touched.cut(amax).copy_(torch.maximum(touched.cut(amax), part))
    agreed = scales_of(amax)
    assert np.array_equal(agreed.numpy(), scales)
    whole = torch.empty(300, 260, dtype=torch.float8_e4m3fn)
    for r0, r1 in rows:
        for c0, c1 in columns:
            touched = Box(((r0 // 128, -(-r1 // 128)), (c0 // 128, -(-c1 // 128))))
            piece, piece_scales = quantize_fp8_block(weight[r0:r1, c0:c1],
                                                     touched.cut(agreed), (r0, c0))
            assert torch.equal(piece_scales, touched.cut(agreed))
            whole[r0:r1, c0:c1] = piece
            restored = dequantize_fp8_block(piece, touched.cut(agreed), torch.float32, (r0, c0))
            expected = dequantize_fp8_block(whole[r0:r1, c0:c1], touched.cut(agreed),
                                            offset=(r0, c0))
            assert torch.equal(restored, expected)
    assert np.array_equal(whole.view(torch.uint8).numpy(), codes)
    full = dequantize_fp8_block(whole, agreed)
    assert torch.equal(dequantize_fp8_block(whole[107:214, 130:], agreed[0:2, 1:3],
                                            offset=(107, 130)), full[107:214, 130:])
    with pytest.raises(ValueError, match=r"covers 2x2 blocks, got 1x2 scales"):
        quantize_fp8_block(weight[107:214, 130:], agreed[:1, 1:], (107, 130))


def test_scale_boxes_one_holder_per_block_and_every_block_a_slice_touches():
    shapes, dtypes = travel_weights(
        {"a.q_proj.weight": (300, 256), "a.q_proj.bias": (300,), "model.norm.weight": (256,)},
        {"a.q_proj.weight": torch.float32, "a.q_proj.bias": torch.float32,
         "model.norm.weight": torch.float32}, torch.bfloat16, "fp8_block")
    assert list(shapes) == ["a.q_proj.weight", "a.q_proj.weight_scale_inv", "a.q_proj.bias",
                            "model.norm.weight"]
    assert shapes["a.q_proj.weight_scale_inv"] == (3, 2)
    assert dtypes == {"a.q_proj.weight": torch.float8_e4m3fn,
                      "a.q_proj.weight_scale_inv": torch.float32,
                      "a.q_proj.bias": torch.bfloat16, "model.norm.weight": torch.bfloat16}
    held = [resolve_layout(fsdp_spec(3, rank), shapes, f"actor rank {rank}", holds=True)
            for rank in range(3)]  # rows 0-99, 100-199, 200-299
    assert [layout.boxes["a.q_proj.weight_scale_inv"].ranges for layout in held] == [
        ((0, 1), (0, 2)), ((1, 2), (0, 2)), ((2, 3), (0, 2))]
    needed = resolve_layout({"boxes": {"a.q_proj.weight": [[150, 300], [0, 100]]}}, shapes,
                            "worker")
    assert needed.boxes["a.q_proj.weight_scale_inv"].ranges == ((1, 3), (0, 1))
    with pytest.raises(ValueError, match="'fp4' is not known"):
        travel_weights(shapes, dtypes, None, "fp4")


def test_an_agreement_frame_replayed_tampered_or_unsealed_is_refused_naming_the_sender():
    sealer, plan = MessageSealer(b"k" * 32), "ab" * 16
    amax = torch.tensor([[1.5, 0.25], [3.0, 0.0]])
    frame = seal_amax(sealer, plan, 4, 1, 0, amax)
    assert len(frame) == amax_frame_bytes(sealer, 4)
    assert torch.equal(open_amax(sealer, frame, plan, 4, 1, 0, amax.shape), amax)
    # replayed as another weight's, as another sender's, back the other way
    for index, sender, receiver in ((5, 1, 0), (4, 2, 0), (4, 0, 1)):
        with pytest.raises(TransferError, match="another tensor's, another plan's or another "
                           "pair of ranks'"):
            open_amax(sealer, frame, plan, index, sender, receiver, amax.shape)
    with pytest.raises(TransferError, match="another plan's"):
        open_amax(sealer, frame, "cd" * 16, 4, 1, 0, amax.shape)
    tampered = bytearray(frame)
    tampered[-1] ^= 1
    with pytest.raises(TransferError, match="from actor rank 1 was not sealed under this "
                       "sync's key"):
        open_amax(sealer, bytes(tampered), plan, 4, 1, 0, amax.shape)
    with pytest.raises(TransferError, match="not sealed"):
        open_amax(MessageSealer(b"o" * 32), frame, plan, 4, 1, 0, amax.shape)


def test_what_stays_unquantized():
    matrix, vector = torch.zeros(4, 4), torch.zeros(4)
    assert quantizes("model.layers.0.self_attn.q_proj.weight", matrix)
    assert quantizes("model.layers.0.mlp.gate_proj.weight", matrix)
    assert quantizes("model.layers.0.mlp.experts.3.down_proj.weight", matrix)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.mlp.shared_expert_gate.weight",
                 "model.layers.0.self_attn.kv_a_layernorm.weight",
                 "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                 "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"):
        assert not quantizes(name, matrix), name
    assert not quantizes("model.layers.0.self_attn.q_proj.bias", matrix)
    assert not quantizes("model.layers.0.self_attn.q_proj.weight", vector)
    assert not quantizes("model.layers.0.self_attn.q_proj.weight", matrix.int())


def _expected(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a receiver must hold: the reference's bytes and scales for every weight that is
    quantized (its scales right after it), every other tensor in bfloat16."""
    expected: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if quantizes(name, tensor):
            codes, scales = reference_fp8_block(tensor)
            expected[name] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
            expected[name + "_scale_inv"] = torch.from_numpy(scales)
        else:
            expected[name] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    return expected


def test_the_stream_quantizes_in_order_and_casts_the_rest():
    weights = make_weights(4, 1 << 20, "decoder")
    streamed = list(QuantizedWeights(weights, torch.bfloat16))
    assert [name for name, _ in streamed] == list(_expected(weights))
    assert digests(dict(streamed)) == digests(_expected(weights))


CONFIG = quantized_config("gloo")


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda ranks: f"{ranks} actor ranks")
def harness(request):
    # every actor rank yields the same full tensors (an FSDP actor's gathers): the delta
    # copy is spread over the ranks, each quantizing the same tensors the same way
    harness = SyncHarness(CONFIG, actor_world_size=request.param,
                          replica_sizes=(1, 1) if request.param == 1 else (1,))
    yield harness
    harness.shutdown()


def test_ten_delta_syncs_of_fp8_are_the_quantized_bytes_on_every_worker(harness):
    check_quantized_delta_syncs(harness)


_TP_LAYOUTS = [None, tensor_parallel_spec(DECODER_BLOCKS, 2, 0),
               tensor_parallel_spec(DECODER_BLOCKS, 2, 1)]
"""The sharded harness's workers: a whole replica, then a TP=2 one."""


def _assert_reference_slices(harness, masters: dict[str, torch.Tensor]) -> None:
    """Every worker of :data:`_TP_LAYOUTS` holds its slices of ``masters`` quantized by
    this file's reference."""
    final = _expected(masters)
    shapes = {name: tuple(tensor.shape) for name, tensor in final.items()}
    for report, spec in zip(harness.reports(), _TP_LAYOUTS, strict=True):
        layout = resolve_layout(spec, shapes, "worker")
        assert report["received"] == {name: digest(box.cut(final[name]).contiguous())
                                      for name, box in layout.boxes.items()}


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda ranks: f"{ranks} FSDP ranks")
def sharded_harness(request):
    harness = SyncHarness(replace(CONFIG, backend="gloo_sharded"),
                          actor_world_size=request.param, replica_sizes=(1, 2))
    yield harness
    harness.shutdown()


def test_ten_sharded_delta_syncs_of_fp8_are_every_workers_slices_of_the_reference(
        sharded_harness):
    # FSDP rows on the actor ranks (blocks spanning 2 and 3 ranks), into a whole replica
    # and a TP=2 replica whose slices cut blocks; then the last sync's slices against the
    # reference quantizer of this file
    metrics = check_sharded_quantized_delta_syncs(sharded_harness)
    # 2% of the masters drawn anew: most blocks' amax, so their scales and every element
    assert 0.0 < metrics[-1]["weightsync/changed_fraction"] < 1.0
    # each pass of the quantizing timed (the agreement's too, where there are ranks to agree)
    passes = {"amax", "quantize"} | ({"agree_scales"} if len(sharded_harness.actors) > 1
                                     else set())
    assert {f"weightsync/passes/{name}" for name in passes} <= set(metrics[-1]), metrics[-1]
    weights = make_weights(11, CONFIG.bucket_size_bytes, "decoder_blocks")
    _assert_reference_slices(sharded_harness, sparse_updates(
        weights, [c for change in QUANTIZED_CHANGES for c in change]))


def test_the_benchmark_measures_bf16_against_fp8_side_by_side():
    from weightsync_core.bench.quantized import run_quantized_benchmark

    result = run_quantized_benchmark("gloo", {}, size_megabytes=16, num_tensors=2, repeats=2,
                                     bucket_megabytes=4)
    derived = result.as_dict()
    assert [row.mode for row in result.rows] == ["bf16", "fp8_block", "fp8_block delta"]
    assert 1.99 < derived["bytes_ratio"] < 2.0  # 1 byte per element and 4 per 128x128 block
    assert 0.0 < result.row("fp8_block delta").changed_fraction < 1.0
    assert set(result.quantize_seconds_per_gib) == {"float32", "bfloat16"}
    assert "bf16 / fp8_block" in result.table()


@pytest.mark.parametrize("experts", ["tensor", "expert"])
def test_sharded_fp8_syncs_of_fused_experts_into_tp_and_ep_replicas(sharded_harness, experts):
    # the actor ranks' FSDP rows of fused experts, streamed per expert; every expert's
    # float8 weights and scales split across the TP replica's workers, or the experts
    # between the EP replica's workers
    if len(sharded_harness.actors) != 2:
        pytest.skip("run with 2 FSDP ranks (the other counts run the decoder's case)")
    check_sharded_quantized_delta_syncs(sharded_harness, experts)


def test_an_actor_rank_that_dies_before_agreeing_scales_is_blamed(sharded_harness):
    # actor rank 1 dies after 3 tensors: the others wait for its part of a quantized
    # weight's block amax, and the sync fails within its timeout naming it; the replaced
    # rank's next sync gives every worker its slices of the reference's bytes and scales
    harness = sharded_harness
    if len(harness.actors) == 1:
        pytest.skip("no other rank to agree scales with")
    ranks = len(harness.actors)
    workers = [worker for replica in harness.replicas for worker in replica.workers]
    ray.get([worker.set_layout.remote(layout) for worker, layout in zip(workers, _TP_LAYOUTS,
                                                                        strict=True)])
    try:
        harness.set_weights(seed=21, profile="decoder_blocks")
        ray.get([actor.set_layout.remote(fsdp_spec(ranks, rank))
                 for rank, actor in enumerate(harness.actors)])
        ray.get(harness.actors[1].set_weights.remote(21, "decoder_blocks", Faults(die_after=3)))
        manager = harness.manager(sync_timeout_seconds=10)
        try:
            with pytest.raises(SyncStageError) as info:
                manager.update_weights_sync(global_steps=21, allow_manifest_change=True)
        finally:
            harness.replace_actor(1)
        assert info.value.worker == "actor_wg rank 1", str(info.value)
        assert "agreeing scales failed with actor rank 1" in str(info.value)  # rank 0 waited
        harness.set_weights(seed=22, profile="decoder_blocks")
        ray.get([actor.set_layout.remote(fsdp_spec(ranks, rank))
                 for rank, actor in enumerate(harness.actors)])
        harness.manager().update_weights_sync(global_steps=22, allow_manifest_change=True)
        _assert_reference_slices(harness,
                                 make_weights(22, CONFIG.bucket_size_bytes, "decoder_blocks"))
    finally:
        ray.get([actor.set_layout.remote(None) for actor in harness.actors])
        ray.get([worker.set_layout.remote(None) for worker in workers])
