"""Layouts and transfer plans: FSDP2 rows into tensor-parallel workers, moving real tensors
piece by piece, bit-exact, and the errors of layouts that cannot work."""

import re
from types import SimpleNamespace

import pytest
import torch

from weightsync_core.data.shards import (
    Box,
    DecoderShape,
    Layout,
    TransferPlan,
    decoder_tensor_parallel_layout,
    fsdp_layout,
    resolve_layout,
)
from weightsync_core.testing.weights import DECODER, make_weights

# the test weights' small Qwen2 (4 query heads of 8, 2 KV heads, MLP 48, a vocabulary of 100,
# not a multiple of 64), plus a scalar
MODEL = DECODER
SHAPES = {**{name: tuple(tensor.shape) for name, tensor in make_weights(0, 1 << 20, "decoder")
             .items()}, "step": ()}


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def _tp(tp_size: int) -> list[Layout]:
    return [decoder_tensor_parallel_layout(SHAPES, MODEL, tp_size, rank)
            for rank in range(tp_size)]


def test_fsdp_rows_follow_torch_chunk_and_scalars_are_replicated():
    held = [fsdp_layout(SHAPES, 2, rank) for rank in range(2)]
    assert held[0].boxes["lm_head.weight"] == Box(((0, 50), (0, 32)))
    assert held[1].boxes["model.layers.0.self_attn.k_proj.bias"] == Box(((8, 16),))
    for rank, layout in enumerate(fsdp_layout({"odd": (5, 3)}, 3, r) for r in range(3)):
        expected = torch.arange(15).reshape(5, 3).chunk(3)
        assert torch.equal(layout.boxes["odd"].cut(torch.arange(15).reshape(5, 3)),
                           expected[rank])
    # 2 rows on 3 ranks: the third holds none (an empty box, as FSDP2's empty local tensor)
    assert fsdp_layout({"two": (2, 4)}, 3, 2).boxes["two"].shape == (0, 4)
    assert all(layout.boxes["step"] == Box(()) and "step" in layout.replicated
               for layout in held)


def test_tensor_parallel_layout_is_vllms_split():
    tp2 = _tp(2)
    assert tp2[1].boxes["model.embed_tokens.weight"] == Box(((64, 100), (0, 32)))  # padded
    assert tp2[1].boxes["model.layers.0.self_attn.q_proj.weight"] == Box(((16, 32), (0, 32)))
    assert tp2[1].boxes["model.layers.0.self_attn.k_proj.weight"] == Box(((8, 16), (0, 32)))
    assert tp2[1].boxes["model.layers.0.self_attn.o_proj.weight"] == Box(((0, 32), (16, 32)))
    assert tp2[0].boxes["model.layers.0.mlp.down_proj.weight"] == Box(((0, 32), (0, 24)))
    assert tp2[0].boxes["model.norm.weight"] == Box.whole(SHAPES["model.norm.weight"])
    # TP=4 over 2 KV heads: each head on two ranks
    kv = [layout.boxes["model.layers.0.self_attn.v_proj.bias"] for layout in _tp(4)]
    assert kv == [Box(((0, 8),)), Box(((0, 8),)), Box(((8, 16),)), Box(((8, 16),))]
    with pytest.raises(ValueError, match="num_attention_heads 4 does not divide into 3"):
        decoder_tensor_parallel_layout(SHAPES, MODEL, 3, 0)
    with pytest.raises(ValueError, match="rank 2 is not a rank of 2"):
        decoder_tensor_parallel_layout(SHAPES, MODEL, 2, 2)


def test_a_plan_moves_fsdp_rows_into_tp_workers_bit_exact():
    """2 FSDP ranks -> 2 replicas of TP=2 and one of TP=1 (5 rollout ranks): each worker
    gets exactly its boxes, each from the rank that holds those rows, real tensors moved."""
    full = _weights()
    held = [fsdp_layout(SHAPES, 2, rank) for rank in range(2)]
    needed = [*_tp(2), *_tp(2), Layout.whole(SHAPES)]
    plan = TransferPlan.build(SHAPES, held, needed)
    shards = [{name: box.cut(full[name]).clone() for name, box in layout.boxes.items()}
              for layout in held]
    received = [{name: torch.full(box.shape, float("nan")) for name, box in layout.boxes.items()}
                for layout in needed]
    for transfer in plan.transfers:
        source = held[transfer.sender].boxes[transfer.name]
        target = needed[transfer.receiver].boxes[transfer.name]
        piece = transfer.box.within(source).cut(shards[transfer.sender][transfer.name])
        transfer.box.within(target).cut(received[transfer.receiver][transfer.name]).copy_(piece)
    for rank, layout in enumerate(needed):
        for name, box in layout.boxes.items():
            assert torch.equal(received[rank][name], box.cut(full[name])), (rank, name)
    # the TP=1 worker needs everything; the TP=2 workers about half (norms whole; rank 0
    # holds 64 of the 100 vocabulary rows, as vLLM pads the vocabulary to 128)
    per_worker = plan.elements("receiver")
    model = sum(box.numel for box in Layout.whole(SHAPES).boxes.values())
    assert per_worker[4] == model
    assert all(model * 0.4 < per_worker[rank] < model * 0.6 for rank in range(4))
    # the replicated scalar (held by both) goes from the less loaded sender: rank 1, which
    # holds 16 of each norm's 33 rows
    assert {t.sender for t in plan.transfers if t.name == "step"} == {1}
    senders = plan.elements("sender")
    assert abs(senders[0] - senders[1]) < 0.1 * senders[0]



def test_relays_send_each_slice_once_from_the_actors_and_chain_the_replicas():
    """2 FSDP ranks -> 2 replicas of TP=2 and one of TP=1 with relays: the actor ranks send
    each needed box once; every other worker needing the same box gets it forwarded, piece
    by piece, from a worker that received it earlier in the plan; real tensors moved."""
    full = _weights()
    held = [fsdp_layout(SHAPES, 2, rank) for rank in range(2)]
    needed = [*_tp(2), *_tp(2), Layout.whole(SHAPES)]
    plain = TransferPlan.build(SHAPES, held, needed)
    plan = TransferPlan.build(SHAPES, held, needed, relay=True)
    assert plan.digest != plain.digest
    assert TransferPlan.from_data(plan.as_data()) == plan
    received = [{name: torch.full(box.shape, float("nan")) for name, box in layout.boxes.items()}
                for layout in needed]
    arrived: list[set[tuple[str, Box]]] = [set() for _ in needed]
    for transfer in plan.transfers:
        if transfer.relayed:  # forwarded from what the relaying worker already holds
            assert (transfer.name, transfer.box) in arrived[transfer.sender], transfer
            source = needed[transfer.sender].boxes[transfer.name]
            piece = transfer.box.within(source).cut(received[transfer.sender][transfer.name])
        else:
            assert transfer.box.intersection(held[transfer.sender].boxes[transfer.name]) \
                == transfer.box, transfer
            piece = transfer.box.cut(full[transfer.name])
        target = needed[transfer.receiver].boxes[transfer.name]
        transfer.box.within(target).cut(received[transfer.receiver][transfer.name]).copy_(piece)
        arrived[transfer.receiver].add((transfer.name, transfer.box))
    for rank, layout in enumerate(needed):
        for name, box in layout.boxes.items():
            assert torch.equal(received[rank][name], box.cut(full[name])), (rank, name)
    assert plan.elements("receiver") == plain.elements("receiver")
    # the actors send each distinct box once (the TP=1 worker's whole model, each TP slice);
    # the rest is relayed
    distinct = {(name, box) for layout in needed for name, box in layout.boxes.items()}
    assert sum(plan.elements("sender").values()) == sum(box.numel for _, box in distinct)
    assert sum(plan.elements("relay").values()) == sum(
        plain.elements("sender").values()) - sum(box.numel for _, box in distinct)
    # the two TP=2 replicas' workers take turns heading the chains
    relays = plan.elements("relay")
    assert set(relays) >= {0, 1, 2, 3}, relays
    # each actor rank sends about one model instead of one and a half
    assert plan.busiest_sender_bytes() < 0.7 * plain.busiest_sender_bytes()


def test_relays_are_kept_only_where_they_lower_the_busiest_senders_bytes():
    """4 FSDP ranks into 2 whole-model workers: relaying would move the load from the
    actor ranks (half a model each) to the relaying workers (about half a model each, no
    less), so the plan stays plain; in one TP=2 replica only the boxes both workers need
    (the norms, whole, and the scalar) are relayed."""
    held = [fsdp_layout(SHAPES, 4, rank) for rank in range(4)]
    whole = [Layout.whole(SHAPES)] * 2
    plan = TransferPlan.build(SHAPES, held, whole, relay=True)
    assert plan == TransferPlan.build(SHAPES, held, whole)
    tp2 = TransferPlan.build(SHAPES, [fsdp_layout(SHAPES, 2, rank) for rank in range(2)],
                             _tp(2), relay=True)
    relayed = {transfer.name for transfer in tp2.transfers if transfer.relayed}
    assert relayed == {name for name in SHAPES if "norm" in name or name == "step"}, relayed


def test_the_digest_changes_with_the_plan_and_only_with_it():
    held = [fsdp_layout(SHAPES, 2, rank) for rank in range(2)]
    one = TransferPlan.build(SHAPES, held, _tp(2))
    assert one.digest == TransferPlan.build(SHAPES, held, _tp(2)).digest
    assert one.digest != TransferPlan.build(SHAPES, held, _tp(2)[::-1]).digest
    assert one.digest != TransferPlan.build(SHAPES, held, [Layout.whole(SHAPES)] * 2).digest


def test_layouts_that_cannot_work_fail_naming_what_is_wrong():
    held = [fsdp_layout(SHAPES, 2, 0)]  # rank 1's rows are missing
    with pytest.raises(ValueError, match=r"rollout rank 0 needs \[0:100, 0:32\] of tensor "
                       r"'model.embed_tokens.weight', of which the actor ranks hold only "
                       r"1600 of 3200"):
        TransferPlan.build(SHAPES, held, [Layout.whole(SHAPES)])
    overlapping = [Layout({"w": Box(((0, 3),))}), Layout({"w": Box(((2, 4),))})]
    with pytest.raises(ValueError, match=r"actor ranks \[0\] hold \[0:3\] and actor ranks "
                       r"\[1\] hold \[2:4\], which overlap"):
        TransferPlan.build({"w": (4,)}, overlapping, [Layout.whole({"w": (4,)})])
    with pytest.raises(ValueError, match=r"rollout rank 0: its layout's box \[0:5\] of tensor "
                       r"'w' does not fit the tensor's shape \[4\]"):
        TransferPlan.build({"w": (4,)}, [Layout.whole({"w": (4,)})],
                           [Layout({"w": Box(((0, 5),))})])
    with pytest.raises(ValueError, match="actor rank 0: its layout names tensor 'x'"):
        TransferPlan.build({"w": (4,)}, [Layout.whole({"x": (4,)})], [])


def test_a_decoder_shape_is_read_from_a_hugging_face_config():
    llama = SimpleNamespace(num_attention_heads=4, num_key_value_heads=None, hidden_size=32,
                            intermediate_size=48)
    assert DecoderShape.from_hf_config(llama) == DecoderShape(4, 4, 8, 48)
    nested = SimpleNamespace(text_config=SimpleNamespace(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=32,
        intermediate_size=48))
    assert DecoderShape.from_hf_config(nested) == DecoderShape(4, 2, 16, 48)


@pytest.mark.parametrize(("spec", "message"), [
    ({"fsdp": {"world_size": 2.7, "rank": 0}}, "fsdp world_size must be an integer, got 2.7 "
                                                "(float)"),
    ({"fsdp": {"world_size": "2", "rank": 0}}, "fsdp world_size must be an integer, got '2' "
                                                "(str)"),
    ({"fsdp": {"world_size": 2, "rank": True}}, "fsdp rank must be an integer, got True (bool)"),
    ({"tensor_parallel": {"size": 2.0, "rank": 0, **vars(MODEL)}},
     "tensor_parallel size must be an integer, got 2.0 (float)"),
    ({"boxes": {"step": [], "lm_head.weight": [[0, 50.5], [0, 32]]}},
     "boxes 'lm_head.weight' stop must be an integer, got 50.5 (float)"),
])
def test_a_layout_spec_whose_ranks_or_sizes_are_no_integers_is_refused(spec, message):
    with pytest.raises(ValueError, match=re.escape(
            f"actor rank 1: its layout {spec!r} cannot be used: {message}; declare it as an "
            "int, not a float, str or bool")):
        resolve_layout(spec, SHAPES, "actor rank 1")


@pytest.mark.parametrize("value", [0, -2, 8.0, True])
@pytest.mark.parametrize("field", ["num_attention_heads", "num_key_value_heads", "head_dim",
                                   "intermediate_size"])
def test_a_decoder_geometry_of_no_positive_integer_is_refused_naming_the_field(field, value):
    message = re.escape(f"DecoderShape {field} must be a positive integer, got {value!r}")
    with pytest.raises(ValueError, match=message):
        DecoderShape(**{**vars(MODEL), field: value})
    spec = {"tensor_parallel": {"size": 2, "rank": 0, **vars(MODEL), field: value}}
    with pytest.raises(ValueError, match=r"rollout rank 0: its layout .* cannot be used: "
                                         + message):  # not a ZeroDivisionError
        resolve_layout(spec, SHAPES, "rollout rank 0")


def test_a_hugging_face_config_of_no_attention_heads_is_refused_naming_the_field():
    config = SimpleNamespace(num_attention_heads=0, hidden_size=32, intermediate_size=48)
    with pytest.raises(ValueError, match="DecoderShape num_attention_heads must be a positive "
                                         "integer, got 0"):
        DecoderShape.from_hf_config(config)
