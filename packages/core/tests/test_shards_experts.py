"""Mixture-of-experts layouts: what a tensor-parallel or expert-parallel vLLM worker needs
(checked against slices written out from vLLM's rules, not from the layout code), what an
FSDP2 rank of fused experts holds, and fused experts streamed per expert as views."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from weightsync_core.data.shards import (
    DecoderShape,
    MoEShape,
    TransferPlan,
    experts_of_rank,
    fsdp_fused_experts_layout,
    fsdp_layout,
    fused_experts,
    moe_layout,
    moe_spec,
    per_expert_shapes,
    per_expert_stream,
    resolve_layout,
)
from weightsync_core.testing.weights import DECODER, MOE, make_weights

WEIGHTS = make_weights(3, 1 << 20, "moe")
FUSED = make_weights(3, 1 << 20, "moe_fused")
SHAPES = {name: tuple(tensor.shape) for name, tensor in WEIGHTS.items()}
LAYER = "model.layers.0.mlp"
WIDTH = MOE.moe_intermediate_size


def _vllm_slices(tp_size: int, tp_rank: int, expert_parallel: bool) -> dict[str, torch.Tensor]:
    """What vLLM's loaders keep of each expert tensor on worker ``tp_rank``, written out from
    its rules: FusedMoE narrows each expert's w1/w3 (gate/up) rows and w2 (down) columns to
    ``I / tp`` at ``tp_rank``; with expert parallelism each worker keeps whole experts, the
    first ``E % ep`` ranks one more, in consecutive runs (``determine_expert_map``, linear);
    the shared expert is a tensor-parallel MLP either way; the router is replicated."""
    share = WIDTH // tp_size
    base, extra = divmod(MOE.num_experts, tp_size)
    counts = [base + (rank < extra) for rank in range(tp_size)]
    first = sum(counts[:tp_rank])
    mine = range(first, first + counts[tp_rank])
    slices = {f"{LAYER}.gate.weight": WEIGHTS[f"{LAYER}.gate.weight"]}
    for expert in range(MOE.num_experts):
        for projection in ("gate_proj", "up_proj", "down_proj"):
            name = f"{LAYER}.experts.{expert}.{projection}.weight"
            tensor = WEIGHTS[name]
            if expert_parallel:
                if expert in mine:
                    slices[name] = tensor
            elif projection == "down_proj":
                slices[name] = tensor[:, tp_rank * share:(tp_rank + 1) * share]
            else:
                slices[name] = tensor[tp_rank * share:(tp_rank + 1) * share]
    shared = 24 // tp_size
    for projection in ("gate_proj", "up_proj"):
        name = f"{LAYER}.shared_expert.{projection}.weight"
        slices[name] = WEIGHTS[name][tp_rank * shared:(tp_rank + 1) * shared]
    name = f"{LAYER}.shared_expert.down_proj.weight"
    slices[name] = WEIGHTS[name][:, tp_rank * shared:(tp_rank + 1) * shared]
    slices[f"{LAYER}.shared_expert_gate.weight"] = WEIGHTS[f"{LAYER}.shared_expert_gate.weight"]
    return slices


@pytest.mark.parametrize(("tp_size", "expert_parallel"), [(2, False), (4, False), (2, True),
                                                          (4, True)])
def test_moe_layout_cuts_the_slices_vllm_keeps(tp_size: int, expert_parallel: bool) -> None:
    for rank in range(tp_size):
        layout = moe_layout(SHAPES, MOE, tp_size, rank, expert_parallel)
        expected = _vllm_slices(tp_size, rank, expert_parallel)
        got = {name: box.cut(WEIGHTS[name]) for name, box in layout.boxes.items()
               if ".mlp." in name and name.startswith(LAYER)}
        assert sorted(got) == sorted(expected), (rank, sorted(set(got) ^ set(expected)))
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (rank, name)
        # attention as for a dense model: q_proj's rows split
        q_proj = layout.boxes["model.layers.0.self_attn.q_proj.weight"]
        assert q_proj.shape[0] == 32 // tp_size


def test_experts_of_rank_places_as_vllm_linear() -> None:
    assert [experts_of_rank(4, 2, r) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [experts_of_rank(5, 2, r) for r in range(2)] == [range(0, 3), range(3, 5)]
    assert [experts_of_rank(7, 3, r) for r in range(3)] == [range(0, 3), range(3, 5),
                                                             range(5, 7)]


def test_expert_parallel_workers_of_a_replica_cover_every_expert_once() -> None:
    needed = [moe_layout(SHAPES, MOE, 2, rank, expert_parallel=True) for rank in range(2)]
    held = [fsdp_layout(SHAPES, 3, rank) for rank in range(3)]
    plan = TransferPlan.build(SHAPES, held, needed, replicas=[2])
    received = plan.elements("receiver")
    for rank in range(2):
        assert received[rank] == needed[rank].numel()
    experts = [{name for name in layout.boxes if ".experts." in name} for layout in needed]
    assert not experts[0] & experts[1]
    assert len(experts[0] | experts[1]) == 3 * MOE.num_experts


def test_fused_experts_split_by_expert_and_refused_by_rows() -> None:
    shapes = {name: tuple(tensor.shape) for name, tensor in FUSED.items()}
    for rank, owned in enumerate((slice(0, 2), slice(2, 4))):
        layout = moe_layout(shapes, MOE, 2, rank, expert_parallel=True)
        fused = FUSED[f"{LAYER}.experts.gate_up_proj"]
        cut = layout.boxes[f"{LAYER}.experts.gate_up_proj"].cut(fused)
        assert torch.equal(cut, fused[owned])
    whole = moe_layout(shapes, MOE, 1, 0)
    assert whole.boxes[f"{LAYER}.experts.down_proj"].shape == (4, 32, WIDTH)
    with pytest.raises(ValueError, match=r"gate_up_proj.*not one box.*per_expert_stream"):
        moe_layout(shapes, MOE, 2, 0)


@pytest.mark.parametrize(("field", "value", "tensor", "says"), [
    ("moe_intermediate_size", 32, f"{LAYER}.experts.0.gate_proj.weight",
     "moe_intermediate_size = 32 (moe_intermediate_size 16 would fit it)"),
    ("num_experts", 3, f"{LAYER}.experts.3.gate_proj.weight",
     "expert 3's, but the declared geometry has num_experts = 3"),
    ("shared_expert_intermediate_size", 12, f"{LAYER}.shared_expert.gate_proj.weight",
     "shared_expert_intermediate_size = 12"),
])
def test_a_geometry_that_is_not_the_checkpoints_is_refused_naming_the_tensor(
        field: str, value: int, tensor: str, says: str) -> None:
    wrong = MoEShape(**{**vars(MOE), field: value})
    with pytest.raises(ValueError) as info:
        resolve_layout(moe_spec(wrong, 2, 1), SHAPES, "rollout rank 2")
    message = str(info.value)
    assert message.startswith("rollout rank 2: its layout"), message
    assert f"tensor {tensor!r} has shape" in message or f"tensor {tensor!r} is" in message, message
    assert says in message, message
    assert "MoEShape.from_hf_config" in message, message


def test_moe_spec_round_trips_and_checks_its_fields() -> None:
    spec = moe_spec(MOE, 2, 1, expert_parallel=True)
    assert resolve_layout(spec, SHAPES, "w") == moe_layout(SHAPES, MOE, 2, 1, True)
    with pytest.raises(ValueError, match="expert_parallel must be a bool"):
        resolve_layout({"moe": {**spec["moe"], "expert_parallel": "yes"}}, SHAPES, "w")
    with pytest.raises(ValueError, match="num_experts 4 is fewer than the 8 expert-parallel"):
        MoEShape(DecoderShape(8, 8, 8, 48), 4, 16).check(8, expert_parallel=True)
    with pytest.raises(ValueError, match="moe_intermediate_size 16 does not divide into 3"):
        MoEShape(DecoderShape(3, 3, 8, 48), 4, 16).check(3, expert_parallel=False)
    with pytest.raises(ValueError, match="MoEShape num_experts must be a positive integer"):
        MoEShape(DECODER, 0, 16)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_ranks_of_fused_experts_stream_the_experts_they_hold(world_size: int) -> None:
    """Each FSDP2 rank holds its ``torch.chunk`` rows of a fused tensor (whole experts) and
    streams them per expert: the names its layout declares, each a view of the fused
    tensor, equal to the per-expert checkpoint's; together the ranks hold every expert
    once."""
    fused_shapes = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in FUSED.items()}
    assert fused_experts({name: shape for name, (shape, _) in fused_shapes.items()}) == 4
    assert fused_experts(SHAPES) is None  # experts one tensor per expert
    declared = per_expert_shapes(fused_shapes)
    assert list(declared) == list(WEIGHTS)
    assert {name: shape for name, (shape, _) in declared.items()} == SHAPES
    seen: set[str] = set()
    for rank in range(world_size):
        held = fsdp_fused_experts_layout(SHAPES, world_size, rank)
        chunk = math.ceil(MOE.num_experts / world_size)
        local = {name: tensor[rank * chunk:(rank + 1) * chunk] if ".experts." in name
                 else fsdp_layout(SHAPES, world_size, rank).boxes[name].cut(tensor)
                 for name, tensor in FUSED.items()}
        streamed = dict(per_expert_stream(local.items(), first_expert=rank * chunk))
        assert sorted(streamed) == sorted(held.boxes), rank
        for name, tensor in streamed.items():
            assert torch.equal(tensor, held.boxes[name].cut(WEIGHTS[name])), name
            if ".experts." in name:
                fused = local[name.rsplit(".experts.", 1)[0] + ".experts." + (
                    "down_proj" if "down_proj" in name else "gate_up_proj")]
                assert tensor.untyped_storage().data_ptr() == (
                    fused.untyped_storage().data_ptr()), f"{name} was copied"
                seen.add(name)
    assert len(seen) == 3 * MOE.num_experts


def test_streaming_a_fused_expert_tensor_ten_buckets_large_stays_within_two_buckets() -> None:
    """Peak memory of packing a fused ``gate_up_proj`` 10x a bucket (and its ``down_proj``)
    into buckets, measured in a fresh process (its peak resident set reset once the weights
    exist, ``/proc/self/clear_refs``: ``ru_maxrss`` starts at the forking parent's, which
    under pytest hid every growth): the growth stays under two buckets plus 16 MiB of slack
    (the packer's two buffers and the allocator's); materialising the fused tensor whole
    once would add 10 buckets."""
    script = textwrap.dedent("""
        import asyncio, sys
        import torch
        from weightsync_core.data.bucketing import BucketPacker
        from weightsync_core.data.shards import per_expert_stream
        bucket = 8 << 20
        experts, width, hidden = 8, 1280, 1024   # gate_up: 8 x 2560 x 1024 x 4 B = 10 buckets
        weights = {"m.experts.gate_up_proj": torch.ones(experts, 2 * width, hidden),
                   "m.experts.down_proj": torch.ones(experts, hidden, width)}
        copy = sys.argv[1] == "copy"
        def status(field):  # kiB
            with open("/proc/self/status") as lines:
                return next(int(line.split()[1]) for line in lines if line.startswith(field))
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak resident set from here on
        before = status("VmRSS:")
        packer = BucketPacker([torch.empty(bucket, dtype=torch.uint8) for _ in range(2)])
        def source():
            for name, tensor in weights.items():
                yield name, tensor.clone() if copy else tensor
        async def run():
            async for _ in packer.pack(per_expert_stream(source())):
                pass
        asyncio.run(run())
        after = status("VmHWM:")
        print((after - before) * 1024, packer.num_tensors, packer.nbytes)
    """)
    results = {}
    for mode in ("views", "copy"):
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True,
                             text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        growth, tensors, nbytes = map(int, out.stdout.split())
        results[mode] = growth
        assert tensors == 8 * 3 and nbytes == 8 * 3 * 1280 * 1024 * 4
    bucket = 8 << 20
    assert results["views"] < 2 * bucket + (16 << 20), results
    # the check can fail: a stream that copies a fused tensor once goes past the bound
    assert results["copy"] > 2 * bucket + (16 << 20), results
