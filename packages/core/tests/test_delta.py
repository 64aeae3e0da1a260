"""Delta sync's pieces without Ray: one tensor's patch, the two ends of a stream, the
manager's ledger of versions, and the config."""

import asyncio

import pytest
import torch

from weightsync_core import CheckpointEngineConfig, CheckpointEngineManager
from weightsync_core.api.errors import ManifestChangedError, VerificationError
from weightsync_core.data.delta import (
    DeltaBaselineError,
    DeltaPlan,
    DeltaReceiver,
    DeltaSender,
    PatchDigestError,
    PatchKind,
    apply_patch,
    encode_patch,
)
from weightsync_core.testing.weights import (
    ONE_ELEMENT,
    convert_in_place,
    digest,
    digests,
    make_weights,
    sparse_updates,
)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _round_trip(new: torch.Tensor, old: torch.Tensor):
    sender_copy, receiver_copy = old.clone().contiguous(), old.clone().contiguous()
    patch, stats = encode_patch(new, sender_copy)
    apply_patch(patch, receiver_copy, "t")
    assert torch.equal(_bytes(receiver_copy), _bytes(new))
    assert torch.equal(_bytes(sender_copy), _bytes(new))  # the sender's next baseline
    return stats


@pytest.mark.parametrize("fraction", [0.0, ONE_ELEMENT, 0.02, 0.3, 1.0])
def test_every_dtype_and_shape_round_trips_bit_exact(fraction):
    old = make_weights(1, 1 << 20)
    new = sparse_updates(old, [(2, fraction)])
    for name in old:
        stats = _round_trip(new[name], old[name])
        assert stats.changed == int(_words_differ(new[name], old[name]))


def _words_differ(new, old) -> int:
    width = new.element_size()
    a = _bytes(new).view(-1, width) if new.numel() else _bytes(new).view(0, width)
    b = _bytes(old).view(-1, width) if old.numel() else _bytes(old).view(0, width)
    return int((a != b).any(dim=1).sum())


def test_the_smallest_encoding_is_chosen():
    old = torch.randn(10_000).bfloat16()
    cases = {0.0: PatchKind.UNCHANGED, 0.01: PatchKind.POSITIONS, 0.4: PatchKind.BITMASK,
             1.0: PatchKind.WHOLE}
    for fraction, kind in cases.items():
        new = sparse_updates({"w": old}, [(3, fraction)])["w"]
        stats = _round_trip(new, old)
        assert stats.kind is kind, (fraction, stats)
        assert stats.nbytes <= 32 + old.numel() * 2 + 8
    sparse = _round_trip(sparse_updates({"w": old}, [(3, 0.02)])["w"], old)
    assert sparse.nbytes * 10 < old.numel() * 2  # 2% changed: over 10x fewer bytes


def test_nan_and_negative_zero_compare_by_their_bits():
    old = torch.tensor([0.0, float("nan"), 1.0])
    new = torch.tensor([-0.0, float("nan"), 1.0])
    assert _round_trip(new, old).changed == 1


def test_a_copy_that_differs_from_the_senders_is_caught_whole():
    old = torch.randn(1000)
    new = old.clone()
    new[3] = 7.0
    patch, _ = encode_patch(new, old.clone())
    tampered = old.clone()
    tampered[500] += 1  # far from the only element the patch touches
    with pytest.raises(PatchDigestError, match="'w' rebuilt from its delta"):
        apply_patch(patch, tampered, "w")


def test_a_patch_of_another_size_or_no_patch_is_refused():
    patch, _ = encode_patch(torch.ones(10), torch.zeros(10))
    with pytest.raises(ValueError, match="does not fit this worker's copy"):
        apply_patch(patch, torch.zeros(11), "w")
    with pytest.raises(ValueError, match="which is no patch"):
        apply_patch(torch.ones(40), torch.zeros(10), "w")
    sparse = torch.zeros(100)
    sparse[7] = 1.0
    patch, stats = encode_patch(sparse, torch.zeros(100))
    assert stats.kind is PatchKind.POSITIONS
    for position in (100, -1):  # a position past the end, or before the start
        forged = patch.clone()
        forged[32:36] = torch.tensor([position], dtype=torch.int32).view(torch.uint8)
        with pytest.raises(ValueError, match="positions outside its 100 elements"):
            apply_patch(forged, torch.zeros(100), "w")
    with pytest.raises(ValueError, match="holds 1 positions and 0 values"):
        apply_patch(patch[:-8], torch.zeros(100), "w")  # its values cut off
    whole, _ = encode_patch(torch.ones(10), torch.zeros(10))
    with pytest.raises(ValueError, match="the patch is malformed"):
        apply_patch(whole[:-16], torch.zeros(10), "w")
    with pytest.raises(ValueError, match="same shape and dtype"):
        encode_patch(torch.ones(10), torch.zeros(10, dtype=torch.float16))


async def _collect(stream):
    return [(name, tensor.clone()) async for name, tensor in stream]


async def _aiter(pairs):
    for pair in pairs:
        yield pair


def _sync(sender, receiver, weights, plan, dtype=None, server=None):
    """One sync from ``sender`` to ``receiver``; ``server``, if given, loads what arrives
    (copying it into its tensor of each name, unless it is that tensor) and offers its
    tensors for patching in place."""
    async def run():
        sent = await _collect(sender.encode(_aiter(weights.items()), plan, dtype))
        received = {}
        async for name, tensor in receiver.decode(_aiter(sent), plan, in_place=server):
            if server is not None and tensor.data_ptr() != server[name].data_ptr():
                server[name].copy_(tensor)
            received[name] = tensor
        return received, sent
    return asyncio.run(run())


def test_a_server_that_offers_its_tensors_is_patched_in_place_and_no_copy_is_kept():
    weights = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    server = {"w": torch.zeros(64, 64, dtype=torch.bfloat16),  # patched in place
              "b": torch.zeros(64)}  # another dtype than what arrives: a host copy
    sender, receiver = DeltaSender(), DeltaReceiver()
    _sync(sender, receiver, weights, DeltaPlan(version="v1"), torch.bfloat16, server)
    assert receiver.baselines["w"] is server["w"]
    assert receiver.kept_bytes == 64 * 2  # only "b"'s copy
    storage = server["w"].data_ptr()
    for step, version in enumerate(("v2", "v3"), start=1):
        weights = sparse_updates(weights, [(step, 0.02)])
        base = receiver.version
        received, _ = _sync(sender, receiver, weights, DeltaPlan(version, base),
                            torch.bfloat16, server)
        assert received["w"].data_ptr() == storage  # the server's own tensor, patched
        assert torch.equal(_bytes(server["w"]), _bytes(weights["w"].bfloat16()))
        assert torch.equal(server["b"], weights["b"].bfloat16().float())
    server["w"][0, 0] += 1  # the server changed its weights behind the receiver's back
    weights = sparse_updates(weights, [(9, 0.02)])
    with pytest.raises(VerificationError, match="tensor 'w' rebuilt from its delta"):
        _sync(sender, receiver, weights, DeltaPlan("v4", receiver.version), torch.bfloat16,
              server)


def test_what_a_server_gets_is_its_own_to_keep_or_convert():
    """Eleven syncs (full, then ten of patches) to a server that converts every tensor in
    place once it has it and keeps them all: each sync rebuilds the sender's tensors bit-exact,
    and no kept tensor changes after the server's conversion."""
    sender, receiver = DeltaSender(), DeltaReceiver()
    weights = make_weights(7, 1 << 16)
    plan = DeltaPlan(version="v0")
    kept = []
    for step in range(11):
        if step:
            weights = sparse_updates(weights, [(step, 0.02)])
            plan = DeltaPlan(version=f"v{step}", base=plan.version)
        received, _ = _sync(sender, receiver, weights, plan, torch.bfloat16)
        assert {name: digest(t) for name, t in received.items()} == digests(weights,
                                                                             torch.bfloat16)
        for tensor in received.values():
            convert_in_place(tensor)
            kept.append((tensor, digest(tensor)))
    assert [seen for _, seen in kept] == [digest(tensor) for tensor, _ in kept]


def test_sender_and_receiver_move_versions_and_forget_on_failure():
    sender, receiver = DeltaSender(), DeltaReceiver()
    generator = torch.Generator().manual_seed(4)
    weights = {"a": torch.randn(4096, generator=generator),
               "b": torch.randn(300, 70, generator=generator).t(), "c": torch.randn(())}
    first = DeltaPlan(version="v1")
    received, _ = _sync(sender, receiver, weights, first, torch.bfloat16)
    assert sender.version == receiver.version == "v1"
    assert all(received[name].dtype == torch.bfloat16 for name in weights)
    updated = sparse_updates(weights, [(5, 0.02)])
    received, sent = _sync(sender, receiver, updated, DeltaPlan(version="v2", base="v1"),
                           torch.bfloat16)
    assert all(tensor.dtype == torch.uint8 for _, tensor in sent)
    for name, tensor in updated.items():
        assert torch.equal(_bytes(received[name]), _bytes(tensor.to(torch.bfloat16)))
    assert 0 < sender.last_stats.changed < sender.last_stats.elements
    assert sender.last_stats.wire_bytes < sender.last_stats.model_bytes / 5
    # a delta against a version the receiver does not hold: refused, nothing applied
    with pytest.raises(DeltaBaselineError, match="holds version v2, but this sync sends "
                       "deltas against version v1"):
        asyncio.run(_collect(receiver.decode(_aiter([]), DeltaPlan(version="v3", base="v1"))))
    assert receiver.version is None and not receiver.baselines


def test_a_delta_sync_needs_the_last_layout():
    sender = DeltaSender()
    _sync(sender, DeltaReceiver(), {"a": torch.ones(4)}, DeltaPlan(version="v1"))
    with pytest.raises(ManifestChangedError, match=r"'b' was not in the last version.*"
                       "allow_manifest_change=True"):
        _sync(sender, DeltaReceiver(), {"b": torch.ones(4)},
              DeltaPlan(version="v2", base="v1"))
    assert sender.version is None


def test_a_patch_for_a_tensor_the_receiver_lacks_fails_naming_it():
    sender, receiver = DeltaSender(), DeltaReceiver()
    _sync(sender, receiver, {"a": torch.ones(4)}, DeltaPlan(version="v1"))
    receiver.baselines.clear()
    with pytest.raises(VerificationError, match="tensor 'a', of which it holds no copy"):
        _sync(sender, receiver, {"a": torch.ones(4)}, DeltaPlan(version="v2", base="v1"))


def test_delta_is_refused_before_any_byte_moves_where_the_backend_cannot_move_it():
    with pytest.raises(ValueError, match="full_verify_every must be an integer >= 0"):
        CheckpointEngineConfig(backend="gloo", delta=True, full_verify_every=-1)
    with pytest.raises(ValueError, match="delta must be True or False"):
        CheckpointEngineConfig(backend="gloo", delta="yes")
    config = CheckpointEngineConfig(backend="naive", delta=True)
    with pytest.raises(ValueError, match=r"backend 'naive' does not move delta syncs \(a "
                       "colocated engine moves no bytes\\)"):
        CheckpointEngineManager(config, actor_wg=None)


class _WrittenForVerl:
    """An engine written for verl: it knows nothing of weightsync's engine flags."""

    def __init__(self, arrived):
        self.arrived = arrived

    def receive_weights(self, global_steps=None):
        return _aiter(self.arrived)


class _DecodesItsPieces(_WrittenForVerl):
    decodes_own_pieces = True
    share_decoder = None


def test_what_an_engine_receives_is_decoded_by_the_receiver_or_by_the_engine_itself():
    """An engine without the flag (one written for verl) gets its stream decoded by the
    receiver; one that decodes its own pieces gets the receiver and plan to decode with, and
    its stream as it is."""
    sender, receiver = DeltaSender(), DeltaReceiver()
    weights = {"w": torch.arange(6, dtype=torch.float32)}
    full = DeltaPlan("v1")
    sent = asyncio.run(_collect(sender.encode(_aiter(weights.items()), full, None)))
    received = asyncio.run(_collect(receiver.received(_WrittenForVerl(sent), 1, full)))
    assert torch.equal(received[0][1], weights["w"]) and receiver.version == "v1"
    own = _DecodesItsPieces([("w", torch.zeros(1))])
    patch = DeltaPlan("v2", "v1")
    assert asyncio.run(_collect(receiver.received(own, 2, patch)))[0][0] == "w"
    assert own.share_decoder is not None and own.share_decoder.receiver is receiver
    assert own.share_decoder.receives_patches and own.share_decoder.plan == patch
