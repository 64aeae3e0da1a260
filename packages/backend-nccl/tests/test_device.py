"""Device tests: run only where CUDA GPUs exist (skipped elsewhere, with the reason)."""

import asyncio

import pytest
import torch

from weightsync_core.spi import BucketPacker, BucketUnpacker, device_checksum
from weightsync_core.testing import (
    AdapterSyncConformanceTests,
    CheckpointEngineConformanceTests,
    DeltaSyncConformanceTests,
    digests,
    make_weights,
)

one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs (one per Ray actor)"
)


@one_gpu
def test_bucket_packing_on_one_gpu_is_bit_exact():
    bucket = 1 << 20
    weights = {name: tensor.cuda() for name, tensor in make_weights(5, bucket).items()}
    buffers = [torch.empty(bucket, dtype=torch.uint8, device="cuda") for _ in range(2)]
    packer = BucketPacker(buffers, checksum=device_checksum, direct_min_bytes=bucket // 2)
    unpacker = BucketUnpacker()

    async def run():
        received = {}
        async for packed in packer.pack(weights):
            torch.cuda.current_stream().synchronize()
            assert device_checksum(packed.data) == packed.meta.checksum
            received.update(unpacker.unpack(packed.data, packed.meta))
        return received

    assert digests(asyncio.run(run())) == digests(weights)


@one_gpu
def test_delta_patch_of_a_gpu_tensor_against_a_host_copy_is_bit_exact():
    """Delta sync's diff where the weights live (the GPU), against the sender's host copy;
    applied to the receiver's host copy and checked with the device digest."""
    from weightsync_core.spi import DeltaPlan, DeltaReceiver, DeltaSender

    before = {name: tensor.cuda() for name, tensor in make_weights(7, 1 << 20).items()}
    after = {name: tensor.clone() for name, tensor in before.items()}
    for tensor in after.values():
        if tensor.is_floating_point() and tensor.numel():
            tensor.view(-1)[:: 50] += 1
    sender, receiver = DeltaSender(), DeltaReceiver()

    async def sync(weights, plan):
        stream = sender.encode(iter(weights.items()), plan, None)
        return {name: t.clone() async for name, t in receiver.decode(stream, plan)}

    first = DeltaPlan.new()
    asyncio.run(sync(before, first))
    received = asyncio.run(sync(after, DeltaPlan.new(first.version)))
    assert digests(received) == digests({n: t.cpu() for n, t in after.items()})
    assert sender.last_stats.wire_bytes < sender.last_stats.model_bytes


@two_gpus
class TestNCCLConformance(CheckpointEngineConformanceTests, DeltaSyncConformanceTests,
                          AdapterSyncConformanceTests):
    backend = "nccl"
    actor_world_size = 1
    replica_sizes = (1,)
    ray_actor_options = {"num_gpus": 1}  # noqa: RUF012
