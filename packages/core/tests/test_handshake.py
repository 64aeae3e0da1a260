"""The typed engine handshake: each family's announcement and arguments are plain data on the
way (MessagePack carries them, no pickle), typed where they arrive, and refused naming the
key where they are not the engine's."""

import msgspec
import pytest
import torch

from weightsync_core import WeightSyncError
from weightsync_core.api.handshake import Handshake, HandshakeMismatch, from_wire, to_wire
from weightsync_core.data.shards import fsdp_spec, weights_spec
from weightsync_core.data.topology import BroadcastArguments, BroadcastMetadata, RingPlacement
from weightsync_core.engines import (
    ColocatedCheckpointEngine,
    GlooCheckpointEngine,
    RingCheckpointEngine,
    ShardedGlooCheckpointEngine,
)
from weightsync_core.engines.sharded_gloo import ShardedArguments, ShardedMetadata


def _across_processes(data):
    """What another process gets: MessagePack's bytes, decoded without any type."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(data))


def _rows(side):
    """verl's columns (``{key: [rank 0's value, ...]}``) as one kwargs dict per rank."""
    size = len(next(iter(side.values()), []))
    return [{key: values[rank] for key, values in side.items()} for rank in range(size)]


def test_a_broadcast_engine_announces_plain_data_that_comes_back_typed():
    engine = GlooCheckpointEngine(1 << 20, host="127.0.0.1")
    try:
        announced = engine.prepare()
        typed = from_wire(_across_processes(announced), BroadcastMetadata)
        assert typed.host == "127.0.0.1" and to_wire(typed) == announced
    finally:
        engine.close()


def test_every_familys_arguments_cross_msgpack_and_come_back_typed():
    broadcast = [{"host": "a", "port": 1000 + i, "member": f"m{i}",
                  "group": {"port": 7, "members": ["m0", "m2"]} if i in (0, 2) else None}
                 for i in range(3)]
    ring = [{"endpoint": f"tcp://h:{i}"} for i in range(3)]
    weights = weights_spec({"w": ((4, 2), torch.bfloat16), "b": ((3,), torch.float32)})
    sharded = [{"host": "127.0.0.1", "port": 1001 + i, "weights": weights if i == 0 else None,
                "layout": fsdp_spec(2, i) if i < 2 else None} for i in range(3)]
    cases = [(GlooCheckpointEngine, broadcast, BroadcastArguments, 2, 1),
             (RingCheckpointEngine, ring, RingPlacement, 1, 2),
             (ShardedGlooCheckpointEngine, sharded, ShardedArguments, 2, 1),
             (ColocatedCheckpointEngine, [{}, {}], Handshake, 1, 1)]
    for engine_cls, metadata, arguments_type, actor_ranks, rollout_workers in cases:
        actor, rollout = engine_cls.build_topology(actor_ranks, rollout_workers,
                                                   _across_processes(metadata))
        for kwargs in _rows(actor) + _rows(rollout):
            typed = from_wire(_across_processes(kwargs), arguments_type)
            assert to_wire(typed) == kwargs, engine_cls.__name__
    assert from_wire(sharded[0], ShardedMetadata).weights == weights


def test_arguments_that_are_not_the_engines_are_refused_before_anything_connects():
    engine = GlooCheckpointEngine(1 << 20, host="127.0.0.1")
    engine.set_session_key(b"k" * 32)
    for kwargs, problem in [
        ({"rank": "0", "world_size": 2}, "whose 'rank' is '0', not an integer"),
        ({"world_size": 2}, "without 'rank' (it holds 'world_size')"),
        ({"rank": 0, "world_size": 2, "master_metadata": {"host": "a", "port": 0}},
         "whose 'master_metadata' is {'host': 'a', 'port': 0}, not a MasterAddress"),
        ({"rank": 0, "world_size": 2, "master": None}, "with the unknown key 'master'"),
    ]:
        with pytest.raises(WeightSyncError) as info:
            engine.init_process_group(**kwargs)
        assert str(info.value).startswith(
            f"GlooCheckpointEngine.init_process_group: arguments {problem}"), info.value
    assert engine.rank is None  # nothing joined, nothing torn down


def test_from_wire_names_what_is_wrong():
    with pytest.raises(HandshakeMismatch) as info:
        from_wire(["endpoint"], RingPlacement)
    assert info.value.problem == "that is not a dict but list ['endpoint']"
    with pytest.raises(HandshakeMismatch, match=r"whose 'position' is 1\.5, not an integer"):
        from_wire({"position": 1.5, "sync_id": "s"}, RingPlacement)
    with pytest.raises(HandshakeMismatch, match="whose 'sync_id' is '', not a non-empty string"):
        from_wire({"position": 1, "sync_id": ""}, RingPlacement)
