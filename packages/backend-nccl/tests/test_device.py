"""Device tests: run only where CUDA GPUs exist (skipped elsewhere, with the reason)."""

import asyncio

import pytest
import torch

from weightsync_core.spi import BucketPacker, BucketUnpacker, device_checksum
from weightsync_core.testing import (
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


@two_gpus
class TestNCCLConformance(CheckpointEngineConformanceTests, DeltaSyncConformanceTests):
    backend = "nccl"
    actor_world_size = 1
    replica_sizes = (1,)
    ray_actor_options = {"num_gpus": 1}  # noqa: RUF012
