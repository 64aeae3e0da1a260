"""Engine-stage arguments survive vLLM's msgpack transport between its processes (a dataclass
arrives as a dict, a tuple as a list) and reach the engine as the types it annotates."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from weightsync_core import ConversionError
from weightsync_vllm.transfer_engine import typed_arguments


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
