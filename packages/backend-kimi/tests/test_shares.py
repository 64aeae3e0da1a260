"""Share assignment and the kimi topology (no processes needed)."""

import pytest

from weightsync_kimi.shares import ShareAssigner
from weightsync_kimi.topology import kimi_topology


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
    with pytest.raises(ValueError, match="non-empty replicas"):
        kimi_topology(1, [0], [_meta(0)])
