"""weightsync's stand-in for vLLM's StatelessProcessGroup (what verl's Mooncake engine
forms): the interface verl's engine uses, membership by the sync's key, and no code in what
it decodes."""

from __future__ import annotations

import pickle
import socket
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch

from weightsync_core import GroupInitTimeoutError, new_session_key
from weightsync_verl.stateless_group import (
    MAX_DEPTH,
    MAX_PARTS,
    Membership,
    StatelessProcessGroup,
    decode_object,
    encode_object,
    membership,
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _form(port: int, rank: int, world_size: int, key: bytes, timeout: float = 10.0):
    with membership(Membership(key, timeout, f"rank {rank}")):
        return StatelessProcessGroup.create("127.0.0.1", port, rank, world_size)


def _groups(world_size: int, key: bytes) -> list[StatelessProcessGroup]:
    port = _free_port()
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(_form, port, rank, world_size, key) for rank in range(world_size)]
        return [future.result(timeout=30) for future in futures]


def test_verls_bucket_messages_travel_between_ranks_in_order() -> None:
    groups = _groups(3, new_session_key())
    meta = {"w": {"name": "w", "shape": torch.Size([2, 3]), "dtype": torch.bfloat16,
                  "offset": 0}}
    for step in range(3):
        groups[0].send_obj({"bucket_meta": meta, "len": step, "is_last": step == 2}, 1)
    received = [groups[1].recv_obj(0) for _ in range(3)]
    assert [info["len"] for info in received] == [0, 1, 2]
    assert received[0]["bucket_meta"] == meta
    assert isinstance(received[0]["bucket_meta"]["w"]["shape"], torch.Size)
    with ThreadPoolExecutor(3) as pool:
        gathered = list(pool.map(lambda g: g.all_gather_obj({"rank": g.rank}), groups))
    assert gathered == [[{"rank": 0}, {"rank": 1}, {"rank": 2}]] * 3


def test_a_process_without_the_sync_key_cannot_join() -> None:
    port = _free_port()
    with ThreadPoolExecutor(2) as pool:
        owner = pool.submit(_form, port, 0, 2, new_session_key(), 3.0)
        stranger = pool.submit(_form, port, 1, 2, new_session_key(), 3.0)
        for attempt in (owner, stranger):
            with pytest.raises(GroupInitTimeoutError):
                attempt.result(timeout=30)


def test_the_group_forms_only_inside_a_sync() -> None:
    with pytest.raises(RuntimeError, match="inside a weightsync sync"):
        StatelessProcessGroup.create("127.0.0.1", _free_port(), 0, 1)


def test_decoding_never_unpickles() -> None:
    payload = pickle.dumps({"ptr": 1})
    with pytest.raises(msgspec.DecodeError):
        decode_object(payload)
    assert decode_object(encode_object({"dtype": torch.float16})) == {"dtype": torch.float16}
    not_a_dtype = msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"nn"))
    with pytest.raises(ValueError, match="names no torch dtype"):
        decode_object(not_a_dtype)


def test_an_object_larger_than_a_store_request_arrives_whole() -> None:
    groups = _groups(2, new_session_key())
    meta = {f"tiny.{index}": {"name": f"tiny.{index}", "shape": torch.Size([index % 7]),
                              "dtype": torch.bfloat16, "offset": 16 * index}
            for index in range(3000)}
    assert len(encode_object(meta)) > 64 << 10
    groups[1].send_obj(meta, 0)
    assert groups[0].recv_obj(1) == meta


@pytest.mark.parametrize("count", [b"20000000", b"2049", b"0", b"9" * 5000])
def test_a_forged_part_count_is_refused_before_any_part_is_named(count: bytes) -> None:
    """A member (it holds the key) writes a count of parts no value the store holds has:
    the receiver refuses it at once instead of building millions of key names."""
    groups = _groups(2, new_session_key())
    groups[0]._store.client.set("p2p/0/1/0", count)
    with pytest.raises(ValueError, match=rf"group key 'p2p/0/1/0' holds .*, not a count of "
                       rf"parts from 1 to {MAX_PARTS} \(a value the store can hold\)"):
        groups[1].recv_obj(0)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 100_000])
def test_nesting_deeper_than_the_cap_is_a_decode_error(depth: int) -> None:
    nested = b"\x91" * depth + b"\xc0"  # [[[...[None]...]]]
    with pytest.raises(msgspec.DecodeError, match=f"nests deeper than the {MAX_DEPTH} levels"):
        decode_object(nested)
    keyed = b"\x81" + b"\x91" * depth + b"\xc0" + b"\xc0"  # {((...(None,)...),): None}
    with pytest.raises(msgspec.DecodeError, match=f"nests deeper than the {MAX_DEPTH} levels"):
        decode_object(keyed)


def test_nesting_up_to_the_cap_decodes() -> None:
    value: object = None
    for _ in range(MAX_DEPTH):
        value = [value]
    assert decode_object(encode_object(value)) == value


def test_a_size_with_a_negative_dimension_is_a_decode_error() -> None:
    forged = msgspec.msgpack.encode(msgspec.msgpack.Ext(2, msgspec.msgpack.encode([4, -3])))
    with pytest.raises(msgspec.DecodeError, match=r"a torch.Size holds non-negative integer "
                       r"dimensions only: Expected `int` >= 0 - at `\$\[1\]`"):
        decode_object(forged)
    assert decode_object(encode_object(torch.Size([0, 3]))) == torch.Size([0, 3])
