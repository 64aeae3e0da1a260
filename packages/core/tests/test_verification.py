"""Delivery verification names the corrupt, missing or extra tensors."""

import pytest
import torch

from weightsync_core.api.checksums import host_checksum
from weightsync_core.api.errors import VerificationError
from weightsync_core.data.bucketing import BucketMeta, TensorMeta
from weightsync_core.data.verification import DeliveryVerifier


def bucket(names):
    data = torch.arange(64, dtype=torch.uint8)
    metas = [TensorMeta(name, (4,), torch.float32, 16 * i, 16, 16) for i, name in enumerate(names)]
    return data, BucketMeta(0, 64, metas, host_checksum(data))


def test_intact_bucket_passes():
    data, meta = bucket(["a", "b"])
    DeliveryVerifier().check_bucket(data, meta, source="actor rank 0")


def test_corrupt_bucket_names_its_tensors():
    data, meta = bucket(["layer.a", "layer.b"])
    data[5] ^= 1
    with pytest.raises(VerificationError, match=r"corrupt.*layer\.a, layer\.b") as info:
        DeliveryVerifier().check_bucket(data, meta, source="actor rank 0")
    assert info.value.tensors == ["layer.a", "layer.b"]


def test_missing_extra_and_mismatched_tensors_are_named():
    verifier = DeliveryVerifier()
    verifier.record("kept", torch.zeros(2))
    verifier.record("extra", torch.zeros(1))
    verifier.record("reshaped", torch.zeros(3))
    manifest = [("kept", (2,), torch.float32), ("lost", (1,), torch.float32),
                ("reshaped", (4,), torch.float32)]
    with pytest.raises(VerificationError) as info:
        verifier.finish(manifest)
    message = str(info.value)
    assert "missing: lost" in message
    assert "not in the sender's manifest: extra" in message
    assert "reshaped" in message
    assert set(info.value.tensors) == {"lost", "extra", "reshaped"}


def test_incomplete_chunked_tensor_is_reported():
    with pytest.raises(VerificationError, match=r"incomplete.*huge"):
        DeliveryVerifier().finish([], incomplete=["huge"])


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 4099])
def test_device_checksum_detects_any_single_bit_flip(size):
    from weightsync_core.api.checksums import device_checksum

    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    reference = device_checksum(data)
    assert device_checksum(data.clone()) == reference
    for position in {0, size // 2, size - 1} if size else set():
        for bit in (0, 7):
            flipped = data.clone()
            flipped[position] ^= 1 << bit
            assert device_checksum(flipped) != reference
