"""Share assignment and the kimi topology (no processes needed)."""

import msgspec
import pytest

from weightsync_core import MetadataError
from weightsync_core.spi import from_wire
from weightsync_kimi.engine import KimiCheckpointEngine
from weightsync_kimi.shares import ShareAssigner
from weightsync_kimi.topology import KimiPlan


def kimi_topology(actor_wg_world_size, replica_sizes, metadata):
    """The plans of a kimi sync, through the engine's verl-shaped handshake (plain data),
    rebuilt typed as each process's init_process_group gets them."""
    actor, rollout = KimiCheckpointEngine.build_replica_topology(
        actor_wg_world_size, replica_sizes, metadata)
    actor, rollout = msgspec.msgpack.decode(msgspec.msgpack.encode((actor, rollout)))
    return tuple({"plan": [from_wire({key: values[rank] for key, values in side.items()},
                                     KimiPlan)
                           for rank in range(len(side["role"]))]}
                 for side in (actor, rollout))


def test_assignment_is_deterministic_and_balanced():
    sizes = [100, 10, 10, 10, 50, 40, 1, 1, 30]
    first, second = ShareAssigner(3), ShareAssigner(3)
    owners = [first.owner(n) for n in sizes]
    assert owners == [second.owner(n) for n in sizes]
    assert set(owners) == {0, 1, 2}
    assert max(first.loads) - min(first.loads) <= max(sizes)


def test_assignment_needs_a_rank():
    with pytest.raises(ValueError, match="world_size"):
        ShareAssigner(0)


def _meta(index):
    return {"endpoint": f"tcp://h:{index}", "peer": f"h:{index}", "cache": None,
            "collective": "gloo", "inner": {"host": "127.0.0.1", "port": 1000 + index,
                                            "member": f"m{index}", "group": None}}


def test_topology_has_one_leader_per_replica_and_owners_everywhere():
    metadata = [_meta(i) for i in range(2 + 3)]
    actors, rollout = kimi_topology(2, [1, 2], metadata)
    assert [p.role for p in actors["plan"]] == ["owner", "owner"]
    assert actors["plan"][0].leaders == ("tcp://h:2", "tcp://h:3")
    assert [p.role for p in rollout["plan"]] == ["leader", "leader", "member"]
    assert rollout["plan"][0].inner is None  # a single-worker replica has no group
    assert rollout["plan"][1].inner["rank"] == 0
    assert rollout["plan"][2].inner["rank"] == 1
    assert len(rollout["plan"][1].owners) == 2
    assert len({p.sync_id for p in actors["plan"] + rollout["plan"]}) == 1


def test_topology_refuses_empty_replicas():
    with pytest.raises(ValueError, match="at least one actor rank and one rollout worker in "
                                         "each replica"):
        kimi_topology(1, [0], [_meta(0)])


def test_a_process_whose_metadata_is_not_kimis_is_named():
    metadata = [_meta(i) for i in range(2 + 3)]
    del metadata[3]["collective"]
    with pytest.raises(MetadataError, match=r"^rollout rank 1 returned metadata without "
                                            r"'collective'") as info:
        kimi_topology(2, [1, 2], metadata)
    assert info.value.index == 3
