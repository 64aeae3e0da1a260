"""Engine-stage arguments survive vLLM's msgpack transport between its processes (a dataclass
arrives as a dict, a tuple as a list, a torch dtype by its name) and reach the engine as the
types it annotates."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from weightsync_core import BucketMeta, ConversionError, TensorMeta, WeightSyncError
from weightsync_core.spi import RemoteBuffer
from weightsync_vllm.stage_arguments import plain_arguments, typed_arguments


@dataclasses.dataclass(frozen=True)
class Owner:
    rank: int
    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    role: str
    owners: tuple[Owner, ...]


def init_process_group(plan: Plan, key: bytes, peers: list[str] | None = None) -> None:
    """An engine stage annotated as kimi's is."""


def test_dataclass_arguments_are_rebuilt_from_what_msgpack_delivers():
    plan = Plan("leader", (Owner(0, ("a", "b")), Owner(1, ("c",))))
    sent = {"plan": plan, "key": b"\x00secret", "peers": ["10.0.0.1"]}
    delivered = msgspec.msgpack.decode(msgspec.msgpack.encode(sent))
    assert delivered["plan"] == {"role": "leader", "owners": [
        {"rank": 0, "names": ["a", "b"]}, {"rank": 1, "names": ["c"]}]}

    assert typed_arguments(init_process_group, delivered) == sent


def test_unannotated_or_unresolvable_arguments_pass_through():
    def stage(plan: NotDefinedAnywhere, count) -> None:  # noqa: F821
        """Annotations that do not resolve in this module."""

    assert typed_arguments(stage, {"plan": {"x": 1}, "count": 2}) == {"plan": {"x": 1},
                                                                      "count": 2}


def test_a_key_the_dataclass_lacks_is_refused():
    with pytest.raises(ConversionError, match=r"unknown key 'rank' \(given 0\)"):
        typed_arguments(init_process_group, {"plan": {"role": "leader", "owners": [], "rank": 0},
                                             "key": b""})


def test_kimis_plan_with_a_cached_share_crosses_msgpack_and_comes_back_typed():
    """From the second sync on, a replica leader's plan holds each actor rank's cached share,
    whose tensor entries carry torch dtypes: kimi's handshake hands them on as plain data (a
    dtype by its name), which MessagePack (vLLM's, between its processes) carries as it is,
    and the engine rebuilds its typed plan from it."""
    from weightsync_core.spi import from_wire, to_wire
    from weightsync_kimi.engine import KimiCheckpointEngine
    from weightsync_kimi.shares import ShareManifest
    from weightsync_kimi.topology import KimiPlan, Owner

    pieces = [TensorMeta("a", (2, 3), torch.bfloat16, 0, 12, 12),
              TensorMeta("b", (4,), torch.int64, 256, 32, 32)]
    share = ShareManifest(0, "127.0.0.1:1234", "update", [
        (BucketMeta(0, 288, pieces, checksum=2**64 - 1), RemoteBuffer(1 << 40, 288))],
        [("a", (2, 3), torch.bfloat16), ("b", (4,), torch.int64)], global_steps=7)
    plan = KimiPlan(role="leader", sync_id="sync",
                    owners=(Owner(endpoint="tcp://127.0.0.1:1", peer="peer", cache=share),))
    with pytest.raises(TypeError, match=r"torch\.dtype"):
        msgspec.msgpack.encode(msgspec.structs.asdict(plan))  # the typed plan would not cross

    sent = plain_arguments([to_wire(plan)])
    assert sent == [to_wire(plan)]  # plain already: nothing left to convert
    delivered = msgspec.msgpack.decode(msgspec.msgpack.encode(sent))
    engine = KimiCheckpointEngine.__new__(KimiCheckpointEngine)
    assert typed_arguments(engine.init_process_group, delivered[0]) == delivered[0]
    assert from_wire(delivered[0], KimiPlan) == plan


def test_plain_arguments_keep_bytes_and_refuse_what_msgpack_cannot_carry():
    plain = plain_arguments({"key": b"\x00k", "shape": torch.Size([2, 3]),
                             "dtype": torch.float16})
    assert plain == {"key": b"\x00k", "shape": (2, 3), "dtype": "float16"}
    assert type(plain["shape"]) is tuple
    with pytest.raises(WeightSyncError, match="Tensor cannot cross vLLM's process boundary"):
        plain_arguments({"tensor": torch.zeros(1)})
