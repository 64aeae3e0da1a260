"""The planner's mixtures of experts: bytes per worker as vLLM splits them (checked against
core's own ``moe_layout`` on a checkpoint's shapes), the published models' sizes, delta
syncs' wire share, and the CLI's ``--moe``/``--changed-fraction``."""

from __future__ import annotations

import math

import pytest

from weightsync_core.cli import main
from weightsync_core.data.shards import DecoderShape, MoEShape, moe_layout
from weightsync_core.plan.moe import MOE_MODELS, MoEModelSize, delta_wire_fraction

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 4, 4, 16, 256
EXPERTS, WIDTH, SHARED, DENSE = 6, 32, 48, 96


def _checkpoint_shapes() -> dict[str, tuple[int, ...]]:
    """A Qwen2-MoE-style checkpoint: layer 0 dense, layers 1-2 mixtures of experts with a
    shared expert."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for layer in range(3):
        prefix = f"model.layers.{layer}"
        shapes.update({
            f"{prefix}.input_layernorm.weight": (HIDDEN,),
            f"{prefix}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"{prefix}.post_attention_layernorm.weight": (HIDDEN,),
        })
        if layer == 0:
            shapes.update({f"{prefix}.mlp.gate_proj.weight": (DENSE, HIDDEN),
                           f"{prefix}.mlp.up_proj.weight": (DENSE, HIDDEN),
                           f"{prefix}.mlp.down_proj.weight": (HIDDEN, DENSE)})
            continue
        shapes[f"{prefix}.mlp.gate.weight"] = (EXPERTS, HIDDEN)
        for expert in range(EXPERTS):
            for projection, shape in (("gate_proj", (WIDTH, HIDDEN)),
                                      ("up_proj", (WIDTH, HIDDEN)),
                                      ("down_proj", (HIDDEN, WIDTH))):
                shapes[f"{prefix}.mlp.experts.{expert}.{projection}.weight"] = shape
        shapes.update({f"{prefix}.mlp.shared_expert.gate_proj.weight": (SHARED, HIDDEN),
                       f"{prefix}.mlp.shared_expert.up_proj.weight": (SHARED, HIDDEN),
                       f"{prefix}.mlp.shared_expert.down_proj.weight": (HIDDEN, SHARED)})
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def _size() -> MoEModelSize:
    return MoEModelSize(
        "test", hidden_size=HIDDEN, num_layers=3, vocab_size=VOCAB,
        attention_params=4 * HIDDEN * HEADS * HEAD_DIM, num_experts=EXPERTS,
        moe_intermediate_size=WIDTH, dense_layers=1, dense_intermediate_size=DENSE,
        shared_intermediate_size=SHARED, bytes_per_param=2.0)


@pytest.mark.parametrize(("workers", "expert_parallel"), [(1, False), (2, False), (4, False),
                                                          (2, True), (4, True)])
def test_bytes_per_worker_are_the_layouts_of_the_busiest_worker(workers, expert_parallel):
    """The planner's count equals what ``moe_layout`` gives each worker of the checkpoint
    (the busiest one: with 6 experts over 4 workers, 2 of them hold 2), less the shared
    expert's gate, which this checkpoint lacks."""
    shapes = _checkpoint_shapes()
    model = MoEShape(DecoderShape(HEADS, KV_HEADS, HEAD_DIM, DENSE, VOCAB), EXPERTS, WIDTH,
                     SHARED)
    size = _size()
    assert size.params * 2 == size.model_bytes == 2 * sum(map(math.prod, shapes.values()))
    busiest = max(moe_layout(shapes, model, workers, rank, expert_parallel).numel()
                  for rank in range(workers))
    assert size.worker_bytes(workers, expert_parallel) == 2 * busiest
    fraction = size.replicated_fraction(workers, expert_parallel)
    per_worker = size.model_bytes * ((1 - fraction) / workers + fraction)
    assert per_worker == pytest.approx(size.worker_bytes(workers, expert_parallel))


def test_the_published_models_have_their_published_sizes():
    assert MOE_MODELS["qwen3-235b-a22b"].params == pytest.approx(235.1e9, rel=1e-3)
    assert MOE_MODELS["qwen3-30b-a3b"].params == pytest.approx(30.53e9, rel=1e-3)
    assert MOE_MODELS["kimi-k2"].params == pytest.approx(1.026e12, rel=1e-3)
    assert MOE_MODELS["kimi-k2"].model_bytes == MOE_MODELS["kimi-k2"].params  # FP8


def test_a_delta_sends_positions_and_values_of_what_changed():
    assert delta_wire_fraction(0.02, 2) == pytest.approx(0.02 * 6 / 2, rel=1e-3)  # int32 + bf16
    assert delta_wire_fraction(0.3, 2) == pytest.approx((1 / 8 + 0.3 * 2) / 2, rel=1e-3)
    assert delta_wire_fraction(1.0, 2) == pytest.approx(1.0, rel=1e-3)
    assert delta_wire_fraction(0.0, 2) < 1e-5
    with pytest.raises(ValueError, match="within"):
        delta_wire_fraction(1.5)


def test_cli_plans_a_published_moe_with_and_without_delta(capsys):
    argv = ["plan", "--device", "gpu", "--moe", "qwen3-235b-a22b", "--actor-ranks-per-host",
            "8", "--workers-per-replica", "8", "--rollout-workers-per-host", "8",
            "--nics-per-host", "8", "--nic-gbit", "400", "--nic-latency-us", "5",
            "--intra-gbyte", "450"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("470.187 GB from 8 actor ranks")
    assert "1.23 s, bound by rollout host NIC downlinks (58.9 GB each)" in out
    assert main([*argv, "--changed-fraction", "0.02"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("28.2117 GB from 8 actor ranks")
    assert "bound by rollout host NIC downlinks (3.53 GB each)" in out
    assert main([*argv, "--model-gb", "1"]) == 2
    assert "leave out --model-gb" in capsys.readouterr().err
    assert main(["plan", "--model-gb", "1", "--expert-parallel"]) == 2
    assert "--expert-parallel needs --moe" in capsys.readouterr().err
