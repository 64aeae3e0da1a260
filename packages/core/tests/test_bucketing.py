"""Bucket packing and unpacking: every dtype and shape, chunking, inputs, validation."""

import asyncio

import pytest
import torch

from weightsync_core.api.checksums import host_checksum
from weightsync_core.data.bucketing import ALIGNMENT, BucketPacker, BucketUnpacker
from weightsync_core.testing import digests, make_weights

BUCKET = 64 << 10


def roundtrip(weights, bucket=BUCKET, rollout_dtype=None, direct_min_bytes=None,
              hash_while_packing=False):
    """Pack into two buffers (holding junk, as the gaps between tensors do) and unpack each
    bucket before the buffer is reused; each bucket's checksum is checked against its
    bytes."""
    buffers = [torch.randint(0, 256, (bucket,), dtype=torch.uint8) for _ in range(2)]
    packer = BucketPacker(buffers, rollout_dtype, host_checksum, direct_min_bytes,
                          hash_while_packing=hash_while_packing)
    unpacker = BucketUnpacker()

    async def run():
        received = {}
        async for bucket in packer.pack(weights):
            assert bucket.meta.checksum == host_checksum(bucket.data)
            for name, tensor in unpacker.unpack(bucket.data, bucket.meta):
                received[name] = tensor
        return received

    received = asyncio.run(run())
    assert unpacker.incomplete() == []
    return received, packer


@pytest.mark.parametrize("hash_while_packing", [False, True])
def test_standard_profile_roundtrips_bit_exact(hash_while_packing):
    weights = make_weights(seed=7, bucket_size=BUCKET)
    received, packer = roundtrip(weights, hash_while_packing=hash_while_packing)
    assert digests(received) == digests(weights)
    assert list(received) == list(weights)
    assert packer.num_tensors == len(weights)
    assert [name for name, _, _ in packer.manifest] == list(weights)


def test_the_packers_byte_count_is_the_tensors_bytes_without_alignment():
    # what a sync reports as weightsync/bytes: one copy of the weights, not the padding
    weights = make_weights(seed=9, bucket_size=BUCKET)
    _, packer = roundtrip(weights)
    assert packer.nbytes == sum(t.numel() * t.element_size() for t in weights.values())


@pytest.mark.parametrize("hash_while_packing", [False, True])
def test_tensor_larger_than_bucket_is_chunked_and_merged(hash_while_packing):
    big = torch.arange(10 * BUCKET // 4 + 3, dtype=torch.float32)
    received, packer = roundtrip({"a": torch.ones(5), "big": big, "b": torch.zeros(2)},
                                 hash_while_packing=hash_while_packing)
    assert torch.equal(received["big"], big)
    assert packer.num_buckets >= 11


def test_buckets_never_exceed_bucket_size_and_offsets_are_aligned():
    weights = make_weights(seed=8, bucket_size=BUCKET)
    buffers = [torch.empty(BUCKET, dtype=torch.uint8) for _ in range(2)]
    packer = BucketPacker(buffers)

    async def metas():
        return [bucket.meta async for bucket in packer.pack(weights)]

    for meta in asyncio.run(metas()):
        assert meta.nbytes <= BUCKET
        for tensor in meta.tensors:
            assert tensor.offset % ALIGNMENT == 0
            assert tensor.offset + tensor.nbytes <= meta.nbytes


@pytest.mark.parametrize("kind", ["dict", "list", "generator", "async generator"])
def test_accepts_sync_and_async_iterables_and_state_dicts(kind):
    weights = {"x": torch.randn(3, 4), "y": torch.tensor(True)}

    async def agen():
        for item in weights.items():
            yield item

    source = {
        "dict": weights,
        "list": list(weights.items()),
        "generator": (item for item in weights.items()),
        "async generator": agen(),
    }[kind]
    received, _ = roundtrip(source)
    assert digests(received) == digests(weights)


def test_rollout_dtype_casts_floating_tensors_only():
    weights = {"f": torch.randn(4), "i": torch.arange(3), "h": torch.randn(2).half()}
    received, _ = roundtrip(weights, rollout_dtype=torch.bfloat16)
    assert received["f"].dtype == torch.bfloat16 and received["h"].dtype == torch.bfloat16
    assert torch.equal(received["f"], weights["f"].to(torch.bfloat16))
    assert received["i"].dtype == torch.int64


def test_received_tensors_survive_buffer_reuse():
    weights = {f"t{i}": torch.full((BUCKET // 8,), float(i)) for i in range(6)}
    received, _ = roundtrip(weights)
    for i in range(6):
        assert torch.all(received[f"t{i}"] == i)


def test_duplicate_names_are_refused_with_the_name():
    with pytest.raises(ValueError, match="duplicate tensor name 'w'"):
        roundtrip([("w", torch.ones(1)), ("w", torch.ones(1))])


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (("w", [1.0]), "weight 'w' is a list, not a torch.Tensor"),
        ((3, torch.ones(1)), "tensor names must be strings"),
        (("w",), r"\(name, tensor\) pairs"),
    ],
)
def test_malformed_items_are_refused(item, message):
    with pytest.raises(TypeError, match=message):
        roundtrip([item])


def test_non_iterable_weights_are_refused():
    with pytest.raises(TypeError, match="iterable or async iterable"):
        roundtrip(42)


def test_buffers_must_be_equal_and_big_enough():
    with pytest.raises(ValueError, match="share one size"):
        BucketPacker([torch.empty(1024, dtype=torch.uint8), torch.empty(2048, dtype=torch.uint8)])


def test_large_tensors_are_sent_from_their_own_memory_without_a_copy():
    big = torch.randn(3 * BUCKET // 4 + 5)  # over 3 buckets: split into direct chunks
    weights = {"small.0": torch.randn(10), "big": big, "small.1": torch.arange(7)}
    buffers = [torch.empty(BUCKET, dtype=torch.uint8) for _ in range(2)]
    packer = BucketPacker(buffers, direct_min_bytes=BUCKET // 2)

    async def direct_pointers():
        return [bucket.buffer.data_ptr() async for bucket in packer.pack(weights)
                if bucket.meta.tensors and bucket.meta.tensors[0].name == "big"]

    pointers = asyncio.run(direct_pointers())
    assert pointers[0] == big.data_ptr() and len(pointers) == 4


@pytest.mark.parametrize("hash_while_packing", [False, True])
def test_direct_and_packed_buckets_interleave_bit_exact(hash_while_packing):
    weights = make_weights(seed=9, bucket_size=BUCKET)
    weights["model.mid"] = torch.randn(BUCKET // 4 // 2)  # exactly half a bucket: direct
    received, _ = roundtrip(weights, direct_min_bytes=BUCKET // 2,
                            hash_while_packing=hash_while_packing)
    assert digests(received) == digests(weights)


def test_synchronous_iteration_validates_and_refuses_an_async_only_source():
    from weightsync_core.data.bucketing import iter_named_tensors_sync

    weights = {"x": torch.ones(2), "y": torch.zeros(3)}
    assert [name for name, _ in iter_named_tensors_sync(weights)] == ["x", "y"]
    with pytest.raises(ValueError, match="duplicate tensor name 'x'"):
        list(iter_named_tensors_sync([("x", torch.ones(1)), ("x", torch.ones(1))]))

    async def only_async():
        yield "x", torch.ones(1)

    with pytest.raises(TypeError, match="only async for can iterate"):
        list(iter_named_tensors_sync(only_async()))


@pytest.mark.parametrize("late", [("a", torch.ones(2)), ("c", [1.0, 2.0])],
                         ids=["duplicate name", "not a tensor"])
def test_a_bad_item_late_in_a_state_dict_or_list_fails_before_the_first_is_packed(late):
    """A whole list (or state dict) is checked before any bucket is filled: no byte of it
    moves (a generator can only be checked as it yields)."""
    from weightsync_core.data.bucketing import iter_named_tensors, iter_named_tensors_sync

    weights = [("a", torch.ones(2)), ("b", torch.ones(2)), late]
    error = ValueError if late[0] == "a" else TypeError
    with pytest.raises(error, match=repr(late[0])):
        next(iter(iter_named_tensors_sync(weights)))

    async def first():
        return await anext(iter_named_tensors(weights))

    with pytest.raises(error, match=repr(late[0])):
        asyncio.run(first())
    if late[0] == "c":
        with pytest.raises(TypeError, match="'c'"):
            next(iter(iter_named_tensors_sync({"a": torch.ones(1), "c": late[1]})))
