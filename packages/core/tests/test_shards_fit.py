"""Layouts checked against the tensors before any byte moves: a tensor-parallel geometry
that is not the checkpoint's (head_dim, intermediate size, vocabulary, KV heads), boxes out
of range or empty, and replicas whose workers leave part of a tensor to no one are refused,
naming the replica, the worker (as the manager numbers it), the tensor and the shapes."""

import re

import pytest

from weightsync_core.api.errors import MetadataError
from weightsync_core.data.shards import (
    Box,
    DecoderShape,
    Layout,
    LayoutMismatchError,
    TransferPlan,
    boxes_spec,
    check_coverage,
    decoder_tensor_parallel_layout,
    fsdp_layout,
    fsdp_spec,
    plan_layouts,
    resolve_layout,
    tensor_parallel_spec,
    weights_spec,
)
from weightsync_core.engines.sharded_gloo import ShardedGlooCheckpointEngine
from weightsync_core.orchestration.blame import metadata_culprit
from weightsync_core.testing.weights import DECODER, make_weights

# the test weights' small Qwen2: 4 query heads of 8, 2 KV heads, MLP 48, hidden 32, a
# vocabulary of 100 rows
WEIGHTS = make_weights(0, 1 << 20, "decoder")
SHAPES = {name: tuple(tensor.shape) for name, tensor in WEIGHTS.items()}
ACTORS = [fsdp_spec(2, rank) for rank in range(2)]


def _geometry(**fields: int) -> DecoderShape:
    return DecoderShape(**{**vars(DECODER), **fields})


def _tp(model: DecoderShape, size: int) -> list[dict]:
    return [tensor_parallel_spec(model, size, rank) for rank in range(size)]


# (field, wrong value, the first tensor it misfits, its shape, what the geometry gives it, the
# value the tensor says would fit)
MISMATCHES = [
    ("head_dim", 16, "model.layers.0.self_attn.q_proj.weight", [32, 32],
     "num_attention_heads x head_dim = 4 x 16 = 64", "with num_attention_heads 4, head_dim 8"),
    ("head_dim", 4, "model.layers.0.self_attn.q_proj.weight", [32, 32],
     "num_attention_heads x head_dim = 4 x 4 = 16", "with num_attention_heads 4, head_dim 8"),
    ("intermediate_size", 96, "model.layers.0.mlp.gate_proj.weight", [48, 32],
     "intermediate_size = 96", "intermediate_size 48"),
    ("intermediate_size", 24, "model.layers.0.mlp.gate_proj.weight", [48, 32],
     "intermediate_size = 24", "intermediate_size 48"),
    ("num_key_value_heads", 4, "model.layers.0.self_attn.k_proj.weight", [16, 32],
     "num_key_value_heads x head_dim = 4 x 8 = 32", "with head_dim 8, num_key_value_heads 2"),
    ("num_key_value_heads", 1, "model.layers.0.self_attn.k_proj.weight", [16, 32],
     "num_key_value_heads x head_dim = 1 x 8 = 8", "with head_dim 8, num_key_value_heads 2"),
    ("vocab_size", 128, "model.embed_tokens.weight", [100, 32], "vocab_size = 128",
     "vocab_size 100"),
    ("vocab_size", 64, "model.embed_tokens.weight", [100, 32], "vocab_size = 64",
     "vocab_size 100"),
]


@pytest.mark.parametrize(("field", "value", "tensor", "shape", "gives", "fits"), MISMATCHES,
                         ids=[f"{m[0]}={m[1]}" for m in MISMATCHES])
def test_a_geometry_that_is_not_the_checkpoints_is_refused_naming_tensor_and_shapes(
        field, value, tensor, shape, gives, fits):
    """Each field of the geometry, too large and too small: the first tensor it does not fit
    is named with its shape and what the geometry gives it, and the fix is said; before,
    the slices were clipped to the tensor (a q_proj of [0, 32] on rank 1, rows no worker
    got)."""
    model = _geometry(**{field: value})
    spec = tensor_parallel_spec(model, 2, 1)
    expected = (f"tensor {tensor!r} has shape {shape}, {shape[0]} rows, but the declared "
                f"geometry gives it {gives} ({fits} would fit it)")
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        resolve_layout(spec, SHAPES, "rollout rank 2 (replica 1, worker 1)")
    message = str(info.value)
    assert message.startswith("rollout rank 2 (replica 1, worker 1): its layout "), message
    assert "declare the checkpoint's geometry (DecoderShape.from_hf_config" in message
    with pytest.raises(ValueError, match=re.escape(expected)):
        decoder_tensor_parallel_layout(SHAPES, model, 2, 0)


def test_every_misfit_is_counted_and_the_columns_of_row_parallel_layers_checked():
    """head_dim 16 misfits q, k, v (weights and biases) and o_proj in both layers: 14
    tensors; a down_proj whose columns differ from the MLP's width is named by its
    columns."""
    with pytest.raises(ValueError, match=r"q_proj.weight' .* \(14 tensors of the weights do "
                                         r"not fit it, the first named\)"):
        decoder_tensor_parallel_layout(SHAPES, _geometry(head_dim=16), 2, 0)
    shapes = {"model.layers.0.mlp.down_proj.weight": (32, 40)}
    with pytest.raises(ValueError, match=re.escape(
            "tensor 'model.layers.0.mlp.down_proj.weight' has shape [32, 40], 40 columns, but "
            "the declared geometry gives it intermediate_size = 48")):
        decoder_tensor_parallel_layout(shapes, DECODER, 2, 0)
    with pytest.raises(ValueError, match=re.escape(
            "tensor 'model.layers.0.self_attn.o_proj.weight' has shape [32], but a "
            "tensor-parallel layout splits its columns (dimension 1)")):
        decoder_tensor_parallel_layout({"model.layers.0.self_attn.o_proj.weight": (32,)},
                                       DECODER, 2, 0)


def test_the_checkpoints_own_geometry_still_splits_as_vllm_does():
    """The right geometry (with its vocabulary) gives the same slices as before; a rank
    whose share of vLLM's padded vocabulary lies past the last row gets an empty box, which
    is no error, and its replica still covers the model."""
    exact = _geometry(vocab_size=100)
    for rank in range(2):
        assert (decoder_tensor_parallel_layout(SHAPES, exact, 2, rank).boxes
                == decoder_tensor_parallel_layout(SHAPES, DECODER, 2, rank).boxes)
    # 8 heads of 4 over TP=8: 100 rows padded to 128, 16 a rank: rank 7 holds only padding
    model = DecoderShape(num_attention_heads=8, num_key_value_heads=8, head_dim=4,
                         intermediate_size=16, vocab_size=100)
    shapes = {"model.embed_tokens.weight": (100, 32),
              "model.layers.0.self_attn.q_proj.weight": (32, 32),
              "model.layers.0.self_attn.o_proj.weight": (32, 32),
              "model.layers.0.mlp.gate_proj.weight": (16, 32),
              "model.layers.0.mlp.down_proj.weight": (32, 16), "model.norm.weight": (32,)}
    needed = [decoder_tensor_parallel_layout(shapes, model, 8, rank) for rank in range(8)]
    assert needed[7].boxes["model.embed_tokens.weight"] == Box(((100, 100), (0, 32)))
    assert needed[6].boxes["model.embed_tokens.weight"] == Box(((96, 100), (0, 32)))
    held = [fsdp_layout(shapes, 2, rank) for rank in range(2)]
    TransferPlan.build(shapes, held, needed, replicas=[8])


def test_a_decoder_shape_reads_the_vocabulary_from_a_hugging_face_config_and_spec():
    from types import SimpleNamespace

    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                             intermediate_size=48, vocab_size=100)
    assert DecoderShape.from_hf_config(config) == _geometry(vocab_size=100)
    # a geometry without a vocabulary travels as before (no field of None)
    assert "vocab_size" not in tensor_parallel_spec(DECODER, 2, 0)["tensor_parallel"]
    assert resolve_layout(tensor_parallel_spec(_geometry(vocab_size=100), 2, 0), SHAPES,
                          "w").boxes["lm_head.weight"] == Box(((0, 64), (0, 32)))
    for value in (0, -1, 100.0, True):
        with pytest.raises(ValueError, match=re.escape(
                f"DecoderShape vocab_size must be a positive integer, got {value!r}")):
            _geometry(vocab_size=value)


def test_a_mismatched_worker_is_refused_at_planning_naming_it_as_the_manager_does():
    """Replica 0 whole, replica 1 TP=2 whose worker 1 declares head_dim 16: the plan is
    refused, blaming that worker (its place in prepare()'s metadata) by the manager's name,
    with the tensor and both shapes; the manager reads the culprit from the error."""
    specs = [*ACTORS, None, tensor_parallel_spec(DECODER, 2, 0),
             tensor_parallel_spec(_geometry(head_dim=16), 2, 1)]
    with pytest.raises(LayoutMismatchError) as info:
        plan_layouts(SHAPES, specs, 2, [1, 2])
    error = info.value
    assert isinstance(error, MetadataError) and isinstance(error, ValueError)
    assert error.index == 4
    assert str(error).startswith("rollout rank 2 (replica 1, worker 1): its layout ")
    assert error.problem.startswith(
        "whose layout does not fit the weights actor rank 0 declared (its layout ")
    assert ("'model.layers.0.self_attn.q_proj.weight' has shape [32, 32], 32 rows, but the "
            "declared geometry gives it num_attention_heads x head_dim = 4 x 16 = 64"
            in error.problem)
    assert metadata_culprit(error, [{}] * 5) == (4, error.problem)


def test_two_workers_of_one_replica_declaring_one_rank_are_refused_naming_the_second():
    """Both workers of a TP=2 replica declare rank 0: rank 1's slices would reach no one;
    refused naming the replica, the duplicate worker, the first tensor left short, its
    shape, the rows no worker needs and each worker's box."""
    specs = [*ACTORS, None, tensor_parallel_spec(DECODER, 2, 0),
             tensor_parallel_spec(DECODER, 2, 0)]
    with pytest.raises(LayoutMismatchError) as info:
        plan_layouts(SHAPES, specs, 2, [1, 2])
    message = str(info.value)
    assert info.value.index == 4, message
    assert message == (
        "the workers of replica 1 (rollout ranks 1..2) leave 1152 of the 3200 elements of "
        "tensor 'model.embed_tokens.weight' (shape [100, 32]) to no worker, e.g. [64:100, "
        "0:32] (rollout rank 1 (replica 1, worker 0) needs [0:64, 0:32]; rollout rank 2 "
        "(replica 1, worker 1) needs [0:64, 0:32]); rollout rank 2 (replica 1, worker 1) "
        "declares the same layout as rollout rank 1 (replica 1, worker 0): give each worker "
        "of a tensor-parallel replica its own rank (0 .. size - 1) of the replica's size")
    assert info.value.problem.startswith(
        "whose layout leaves part of the model to no worker of its replica (the workers of "
        "replica 1 ")
    # the same layouts in replicas of their own (TP=2 and TP=2 rank 1): each replica short
    specs[4] = tensor_parallel_spec(DECODER, 2, 1)
    plan_layouts(SHAPES, specs, 2, [1, 2])  # the right ranks: fine
    with pytest.raises(LayoutMismatchError, match=r"the workers of replica 1 \(rollout ranks "
                                                  r"1..1\) leave 1152 of the 3200"):
        plan_layouts(SHAPES, specs, 2, [1, 1, 1])


def test_explicit_boxes_must_fit_and_a_replica_must_cover_every_tensor():
    """Boxes past the end, of another number of dimensions or empty are refused naming the
    worker; workers whose boxes leave rows of a tensor (or a whole tensor) to no one are
    refused naming the replica, each worker's box and the rows missing; workers of one
    replica may overlap (each gets its own box)."""
    name = "model.embed_tokens.weight"
    whole = Layout.whole(SHAPES)

    def rows(start: int, stop: int, dropped: str | None = None) -> dict:
        boxes = {**whole.boxes, name: Box(((start, stop), (0, 32)))}
        boxes.pop(dropped, None)
        return boxes_spec(Layout(boxes))

    def refused(workers: list, replicas: list[int] | None, pattern: str) -> LayoutMismatchError:
        with pytest.raises(LayoutMismatchError, match=pattern) as info:
            plan_layouts(SHAPES, [*ACTORS, *workers], 2, replicas)
        return info.value

    past = refused([rows(0, 50), rows(50, 128)], [2], re.escape(
        "rollout rank 1 (replica 0, worker 1): its layout's box [50:128, 0:32] of tensor "
        "'model.embed_tokens.weight' does not fit the tensor's shape [100, 32]"))
    assert past.index == 3
    empty = refused([rows(0, 100), rows(100, 100)], [2], re.escape(
        "rollout rank 1 (replica 0, worker 1): its layout's box [100:100, 0:32] of tensor "
        "'model.embed_tokens.weight' (shape [100, 32]) holds no element"))
    assert empty.index == 3
    flat = boxes_spec(Layout({**whole.boxes, name: Box(((0, 3200),))}))
    refused([flat], [1], re.escape("its layout's box [0:3200] of tensor "
                                   "'model.embed_tokens.weight' does not fit the tensor's "
                                   "shape [100, 32]"))
    gap = refused([rows(0, 48), rows(64, 100)], [2], re.escape(
        "the workers of replica 0 (rollout ranks 0..1) leave 512 of the 3200 elements of "
        "tensor 'model.embed_tokens.weight' (shape [100, 32]) to no worker, e.g. [48:64, "
        "0:32] (rollout rank 0 (replica 0, worker 0) needs [0:48, 0:32]; rollout rank 1 "
        "(replica 0, worker 1) needs [64:100, 0:32]): a replica serves the whole model"))
    assert gap.index is None
    assert metadata_culprit(gap, [{}] * 4) is None  # the manager names the stage
    refused([rows(0, 100, dropped="model.norm.weight"), rows(0, 100, "model.norm.weight")],
            [2], re.escape("33 of the 33 elements of tensor 'model.norm.weight' (shape [33]) "
                           "to no worker, e.g. [0:33] (rollout rank 0 (replica 0, worker 0) "
                           "needs none of it; rollout rank 1 (replica 0, worker 1) needs none "
                           "of it): a replica serves the whole model"))
    # replicas not known (build_topology's sizes only): every worker together must cover
    refused([rows(0, 48), rows(64, 100)], None, re.escape(
        "the rollout workers together leave 512 of the 3200 elements of tensor "
        "'model.embed_tokens.weight' (shape [100, 32]) to no worker, e.g. [48:64, 0:32] "
        "(rollout rank 0 needs [0:48, 0:32]; rollout rank 1 needs [64:100, 0:32])"))
    # overlapping workers of one replica are fine: each gets exactly its own rows
    plan = plan_layouts(SHAPES, [*ACTORS, rows(0, 60), rows(40, 100)], 2, [2])
    embedding = [t for t in plan.transfers if t.name == name]
    assert sum(t.box.numel for t in embedding if t.receiver == 0) == 60 * 32
    assert sum(t.box.numel for t in embedding if t.receiver == 1) == 60 * 32


def test_fsdp_rows_on_workers_may_run_out_before_the_last_worker():
    """A worker layout of FSDP rows (as the testbed's bench declares): with more workers
    than a tensor's rows, the last hold no row of it, which is no error."""
    shapes = {"few": (2, 4), "many": (9, 3), "scalar": ()}
    held = [fsdp_layout(shapes, 1, 0)]
    needed = [fsdp_layout(shapes, 3, rank) for rank in range(3)]
    assert needed[2].boxes["few"].numel == 0
    TransferPlan.build(shapes, held, needed, replicas=[3])


def test_the_sharded_engines_builder_checks_each_replica():
    """``gloo_sharded``'s ``build_replica_topology`` (what the manager calls, and the base of
    ``nixl_sharded`` and ``mooncake_sharded``) refuses a short replica and a misfit geometry;
    ``build_topology`` (sizes only) checks every worker together."""
    weights = weights_spec({name: (tuple(tensor.shape), tensor.dtype)
                            for name, tensor in WEIGHTS.items()})
    actors = [{"host": "127.0.0.1", "port": 1, "layout": spec, "weights": weights,
               "relay": True} for spec in ACTORS]

    def metadata(*layouts):
        return [*actors, *({"host": "127.0.0.1", "port": 2, "layout": layout}
                           for layout in layouts)]

    right = metadata(None, *_tp(DECODER, 2))
    ShardedGlooCheckpointEngine.build_replica_topology(2, [1, 2], right)
    duplicate = metadata(None, *[tensor_parallel_spec(DECODER, 2, 0)] * 2)
    with pytest.raises(LayoutMismatchError, match="rollout rank 2 \\(replica 1, worker 1\\) "
                                                  "declares the same layout") as info:
        ShardedGlooCheckpointEngine.build_replica_topology(2, [1, 2], duplicate)
    assert info.value.index == 4
    ShardedGlooCheckpointEngine.build_topology(2, 3, duplicate)  # together they cover
    for field, value in (("head_dim", 16), ("intermediate_size", 96),
                         ("num_key_value_heads", 1), ("vocab_size", 128)):
        wrong = metadata(None, tensor_parallel_spec(DECODER, 2, 0),
                         tensor_parallel_spec(_geometry(**{field: value}), 2, 1))
        for build in (lambda m: ShardedGlooCheckpointEngine.build_replica_topology(2, [1, 2], m),
                      lambda m: ShardedGlooCheckpointEngine.build_topology(2, 3, m)):
            with pytest.raises(LayoutMismatchError, match="declared geometry gives it") as info:
                build(wrong)
            assert info.value.index == 4, field


def test_a_large_model_is_covered_by_each_full_replica_and_not_by_one_rank_short():
    """8 replicas of TP=8 over a 64-layer model (about 600 tensors): covered; the same with
    the last replica's last worker declaring rank 6 again is refused naming that worker."""
    model = DecoderShape(num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                         intermediate_size=25600, vocab_size=151936)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (151936, 8192)}
    for layer in range(64):
        prefix = f"model.layers.{layer}"
        shapes.update({
            f"{prefix}.input_layernorm.weight": (8192,),
            f"{prefix}.self_attn.q_proj.weight": (8192, 8192),
            f"{prefix}.self_attn.k_proj.weight": (1024, 8192),
            f"{prefix}.self_attn.v_proj.weight": (1024, 8192),
            f"{prefix}.self_attn.o_proj.weight": (8192, 8192),
            f"{prefix}.post_attention_layernorm.weight": (8192,),
            f"{prefix}.mlp.gate_proj.weight": (25600, 8192),
            f"{prefix}.mlp.up_proj.weight": (25600, 8192),
            f"{prefix}.mlp.down_proj.weight": (8192, 25600),
        })
    needed = [decoder_tensor_parallel_layout(shapes, model, 8, rank) for rank in range(8)] * 8
    check_coverage(shapes, needed, [8] * 8)
    with pytest.raises(LayoutMismatchError, match="declares the same layout") as info:
        check_coverage(shapes, [*needed[:-1], needed[-2]], [8] * 8, actor_ranks=2)
    assert info.value.index == 2 + 63
