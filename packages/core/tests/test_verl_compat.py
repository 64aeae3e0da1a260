"""verl's chunk helpers, as weightsync provides them for engines written for verl."""

import asyncio

import pytest
import torch

from weightsync_core.verl_compat import TensorMeta, merge_weight_chunks, split_weight_chunks


def _round_trip(weights, bucket_size):
    async def run():
        chunks = [(meta, chunk.clone()) async for meta, chunk in
                  split_weight_chunks(weights.items(), bucket_size)]

        async def replay():
            for item in chunks:
                yield item

        return chunks, [(name, tensor.clone()) async for name, tensor in
                        merge_weight_chunks(replay(), bucket_size)]

    return asyncio.run(run())


def test_split_and_merge_round_trip_every_shape_including_empty_and_large():
    weights = {
        "big": torch.randn(1000),  # 4000 bytes: 4 chunks of at most 1024
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "odd": torch.arange(7, dtype=torch.int8),
        "transposed": torch.randn(4, 6).t(),
    }
    chunks, merged = _round_trip(weights, 1024)
    assert [meta.chunk_size for meta, _ in chunks if meta.name == "big"] == [1024] * 3 + [928]
    assert [name for name, _ in merged] == list(weights)
    for name, tensor in merged:
        assert torch.equal(tensor, weights[name]) and tensor.dtype == weights[name].dtype


def test_merge_refuses_chunks_out_of_order_or_a_stream_that_stops_inside_a_tensor():
    def meta(offset, size):
        return TensorMeta("w", torch.Size([4]), torch.float32, offset, size)

    async def merge(items):
        async def source():
            for item in items:
                yield item

        return [name async for name, _ in merge_weight_chunks(source())]

    half = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="expected 'w' from byte 8"):
        asyncio.run(merge([(meta(0, 8), half), (meta(0, 8), half)]))
    with pytest.raises(ValueError, match="ended inside 'w'"):
        asyncio.run(merge([(meta(0, 8), half)]))
    with pytest.raises(ValueError, match="must be 8 uint8 bytes"):
        asyncio.run(merge([(meta(0, 8), torch.zeros(2))]))


def test_engines_take_verls_constructor_and_engine_kwargs():
    from weightsync_core import CheckpointEngineRegistry
    from weightsync_core.data.topology import EVERY_LOCAL_ACTOR_RANK

    engine = CheckpointEngineRegistry.new(
        "gloo", bucket_size=1 << 20, is_master=True, multi_sender=True, rebuild_group=True,
        rollout_dtype="bfloat16",
    )
    assert engine.is_master and engine.rebuild_group
    assert engine.senders == EVERY_LOCAL_ACTOR_RANK and engine.rollout_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not both"):
        CheckpointEngineRegistry.new("gloo", bucket_size=1 << 20, senders=2, multi_sender=True)
    with pytest.raises(ValueError, match="'is_master' must be True or False"):
        CheckpointEngineRegistry.new("gloo", bucket_size=1 << 20, is_master="yes")


@pytest.fixture
def restored_registry():
    from weightsync_core import CheckpointEngineRegistry

    saved = dict(CheckpointEngineRegistry._registry)
    yield CheckpointEngineRegistry
    CheckpointEngineRegistry._registry = saved


def _verl_written_engine():
    from weightsync_core.verl_compat import CheckpointEngine

    class VerlWritten(CheckpointEngine):
        def __init__(self, bucket_size, is_master=False):
            self.bucket_size = bucket_size

    return VerlWritten


def test_a_verl_engine_under_a_weightsync_backends_name_is_verl_prefixed(restored_registry):
    # verl's engines register as nixl, nccl, mooncake...: names weightsync's backends hold
    from weightsync_core.engines.gloo import GlooCheckpointEngine
    from weightsync_core.verl_compat import CheckpointEngineRegistry

    engine = CheckpointEngineRegistry.register("gloo")(_verl_written_engine())
    assert restored_registry.get("gloo") is GlooCheckpointEngine
    assert restored_registry.get("verl_gloo") is engine
    assert CheckpointEngineRegistry.get("verl_gloo") is engine


def test_a_verl_engine_under_a_free_name_keeps_it_and_gets_the_verl_name(restored_registry):
    from weightsync_core.verl_compat import CheckpointEngineRegistry

    engine = CheckpointEngineRegistry.register("acme_rdma")(_verl_written_engine())
    assert restored_registry.get("acme_rdma") is engine
    assert restored_registry.get("verl_acme_rdma") is engine
    CheckpointEngineRegistry.register("acme_rdma")(engine)  # imported twice: harmless


def test_a_verl_engine_is_built_with_a_dtype_and_the_syncs_timeout(restored_registry):
    from weightsync_core import CheckpointEngineConfig
    from weightsync_core.verl_compat import CheckpointEngine
    from weightsync_core.worker import build_engine

    @restored_registry.register("verl_dtype_taker")
    class TakesDtype(CheckpointEngine):  # as verl's Mooncake engine, which uses .to(dtype)
        def __init__(self, bucket_size, rollout_dtype=torch.bfloat16, is_master=False):
            self.bucket_size = bucket_size
            self.rollout_dtype = rollout_dtype

        prepare = init_process_group = finalize = send_weights = receive_weights = None
        build_topology = None

    config = CheckpointEngineConfig(backend="verl_dtype_taker", rollout_dtype="float16",
                                    sync_timeout_seconds=42)
    engine = build_engine(config)
    assert engine.rollout_dtype is torch.float16
    assert engine.timeout == 42
