"""Delta's one-pass sweeps (compiled) against an element-by-element reference written here:
every element width, tails shorter than a word, offsets the sweep cannot read as words
(torch's operators then), and patches whose positions fall outside the copy."""

import pytest
import torch

from weightsync_core.data.delta import apply_patch, encode_patch
from weightsync_core.data.delta.kernels import diff_gather, scatter_checked
from weightsync_core.data.delta.patch import diff_into, flat_words

_DTYPES = [torch.uint8, torch.bool, torch.bfloat16, torch.float16, torch.float32,
           torch.int32, torch.float64, torch.int64, torch.complex128]


def _elements(tensor: torch.Tensor) -> torch.Tensor:
    """Each word's bytes as one row (the reference compares rows): an element's, or a byte
    where the width has no integer type (complex128), as patches count them."""
    width = flat_words(tensor).element_size()
    return tensor.reshape(-1).view(torch.uint8).view(-1, width)


def _changed(new: torch.Tensor, old: torch.Tensor) -> list[int]:
    return (_elements(new) != _elements(old)).any(dim=1).nonzero().reshape(-1).tolist()


def _pair(dtype: torch.dtype, numel: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * torch.empty(0, dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=generator)
    old = raw.view(dtype).clone() if dtype != torch.bool else (raw % 2).view(torch.bool)
    new = old.clone()
    picked = torch.randperm(numel, generator=generator)[: max(1, numel // 7)]
    new.view(torch.uint8).view(numel, -1)[picked, 0] ^= 1  # one bit of each picked element
    return new, old


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 7, 8, 1001, 4096])
def test_the_sweep_finds_exactly_the_changed_elements_and_updates_the_copy(dtype, numel):
    new, old = _pair(dtype, numel, seed=numel)
    expected = _changed(new, old)
    copy = old.clone()
    swept = diff_gather(flat_words(new), flat_words(copy), torch.int32)
    assert swept is not None  # aligned host tensors take the sweep
    positions, values = swept
    assert positions.tolist() == expected
    assert torch.equal(values.view(torch.uint8), flat_words(new)[expected].view(torch.uint8))
    assert torch.equal(_elements(copy), _elements(new))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=str)
def test_offsets_the_sweep_cannot_read_as_words_give_the_same_positions(dtype):
    new, old = _pair(dtype, 999, seed=3)
    for start in (1, 3, 8):
        copy = old[start:].clone()
        shifted = torch.empty(copy.numel() + 1, dtype=dtype)[1:]  # off the 8-byte boundary
        shifted.copy_(copy)
        aligned = diff_gather(flat_words(new[start:].clone()), flat_words(copy), torch.int64)
        assert aligned is not None
        assert diff_gather(flat_words(new[start:]), flat_words(shifted), torch.int64) is None
        positions = diff_into(new[start:], shifted)  # torch's operators
        assert positions.tolist() == aligned[0].tolist() == _changed(new[start:], old[start:])
        assert torch.equal(_elements(shifted), _elements(new[start:]))


def test_device_or_mismatched_tensors_are_left_to_torch():
    words = torch.zeros(16, dtype=torch.int16)
    assert diff_gather(words, torch.zeros(15, dtype=torch.int16), torch.int64) is None
    assert scatter_checked(words, torch.tensor([1]), torch.tensor([1], dtype=torch.int32)) \
        is None  # values of another width


def test_a_patch_with_a_position_outside_writes_nothing():
    old = torch.zeros(100, dtype=torch.bfloat16)
    new = old.clone()
    new[[3, 50, 99]] = 1.0
    patch, _ = encode_patch(new, old.clone())
    forged = patch.clone()
    forged[32 + 4 : 32 + 8] = torch.tensor([100], dtype=torch.int32).view(torch.uint8)
    copy = old.clone()
    with pytest.raises(ValueError, match="positions outside its 100 elements"):
        apply_patch(forged, copy, "w")
    assert torch.equal(copy, old)  # the first position (3) was not written either
    assert scatter_checked(flat_words(copy), torch.tensor([3, -1]),
                           torch.ones(2, dtype=torch.int16)) == 1
    assert torch.equal(copy, old)
