"""Broadcast and ring topologies through the engines' verl-shaped handshake (plain data in,
plain data out): single sender, relays on the sender's host only, group reuse; metadata
that is not the engine's refused naming the process."""

import pytest

from weightsync_core.data.sync_layout import SyncLayout
from weightsync_core.data.topology import BroadcastMetadata, SenderShare, plan_sender_shares
from weightsync_core.engines import GlooCheckpointEngine, RingCheckpointEngine
from weightsync_core.engines.typed import decode_metadata

broadcast_topology = GlooCheckpointEngine.build_topology
ring_topology = RingCheckpointEngine.build_topology


def meta(host, member, port=1000, group=None, senders=1):
    return {"host": host, "port": port, "member": member, "group": group, "senders": senders}


def plan_broadcast_groups(actors, rollout_world_size, senders):
    layout = SyncLayout.flat(len(actors), 0)
    return plan_sender_shares(decode_metadata(layout, actors, BroadcastMetadata),
                              rollout_world_size, senders)


def test_single_sender_matches_verl():
    metadata = [meta("a", "s0"), meta("a", "s1"), meta("b", "r0"), meta("c", "r1")]
    actor, rollout = broadcast_topology(2, 2, metadata)
    assert actor["rank"] == [0, -1]
    assert actor["world_size"] == [3, 0]
    assert rollout["rank"] == [1, 2]
    assert rollout["members"] == [("s0", "r0", "r1")] * 2
    master = actor["master_metadata"][0]
    assert master == {"host": "a", "port": 1000, "reuse": False, "sender": 0}
    assert rollout["master_metadata"] == [master, master]


def test_relays_come_only_from_the_sender_host():
    actors = [meta("node0", "a0"), meta("node1", "a1"), meta("node0", "a2"), meta("node0", "a3")]
    groups = plan_broadcast_groups(actors, rollout_world_size=5, senders=3)
    assert groups == [
        SenderShare(0, (0, 1)), SenderShare(2, (2, 3)), SenderShare(3, (4,))
    ]


def test_never_more_senders_than_receivers_and_at_least_rank_zero():
    actors = [meta("n", f"a{i}") for i in range(4)]
    assert plan_broadcast_groups(actors, 2, senders=4) == [
        SenderShare(0, (0,)), SenderShare(1, (1,))
    ]
    lonely = [meta("n", "a0"), meta("m", "a1")]
    assert plan_broadcast_groups(lonely, 3, senders=2) == [SenderShare(0, (0, 1, 2))]
    with pytest.raises(ValueError, match="senders must be >= 1"):
        plan_broadcast_groups(actors, 2, senders=0)


def test_multi_sender_kwargs_give_each_group_its_own_master():
    metadata = [meta("n", "a0", 1, senders=2), meta("n", "a1", 2, senders=2),
                meta("x", "r0"), meta("y", "r1"), meta("z", "r2")]
    actor, rollout = broadcast_topology(2, 3, metadata)
    assert actor["rank"] == [0, 0]
    assert actor["world_size"] == [3, 2]
    assert rollout["rank"] == [1, 2, 1]
    assert [m["port"] for m in rollout["master_metadata"]] == [1, 1, 2]
    assert [m["sender"] for m in rollout["master_metadata"]] == [0, 0, 1]
    assert rollout["members"][2] == ("a1", "r2")


def test_group_is_reused_only_when_every_member_holds_it():
    key = {"port": 555, "members": ["a0", "r0", "r1"]}
    intact = [meta("n", "a0", 1, key), meta("n", "a1"), meta("x", "r0", group=key),
              meta("y", "r1", group=key)]
    master = broadcast_topology(2, 2, intact)[0]["master_metadata"][0]
    assert master == {"host": "n", "port": 555, "reuse": True, "sender": 0}

    one_lost_it = [*intact[:3], meta("y", "r1", group=None)]
    master = broadcast_topology(2, 2, one_lost_it)[0]["master_metadata"][0]
    assert master == {"host": "n", "port": 1, "reuse": False, "sender": 0}

    new_member = [*intact[:3], meta("y", "r9", group=None)]
    assert broadcast_topology(2, 2, new_member)[0]["master_metadata"][0]["reuse"] is False


def test_engine_build_topology_validates_sizes():
    with pytest.raises(ValueError, match="at least one actor rank and one rollout worker"):
        GlooCheckpointEngine.build_topology(1, 0, [meta("n", "a0")])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"senders": 0}, "'senders' must be a positive integer"),
     ({"group_init_timeout": 0}, "'group_init_timeout' must be > 0")],
)
def test_engine_options_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GlooCheckpointEngine(1 << 20, **kwargs)


def test_ring_topology_chains_actor_rank_0_through_every_rollout_worker():
    metadata = [{"endpoint": f"tcp://h:{i}"} for i in range(2 + 3)]
    actors, rollout = ring_topology(2, 3, metadata)
    assert actors["position"] == [0, -1]
    assert actors["downstream"] == ["tcp://h:2", None]
    assert rollout["position"] == [1, 2, 3]
    assert rollout["upstream"] == ["tcp://h:0", "tcp://h:2", "tcp://h:3"]
    assert rollout["downstream"] == ["tcp://h:3", "tcp://h:4", None]
    assert rollout["upstream_name"] == ["actor rank 0", "rollout rank 0", "rollout rank 1"]
    assert len(set(actors["sync_id"] + rollout["sync_id"])) == 1


def test_ring_topology_needs_both_sides():
    with pytest.raises(ValueError, match="at least one actor rank and one rollout worker"):
        ring_topology(1, 0, [{"endpoint": "tcp://h:1"}])


@pytest.mark.parametrize(("lie", "index", "problem"), [
    ({"host": "a", "member": "s0", "group": None}, 0, "without 'port' (it holds 'host', "
                                                      "'member', 'group')"),
    ("garbage", 2, "that is not a dict but str 'garbage'"),
    (meta("a", "s0", port="29500"), 0, "whose 'port' is '29500', not a port number"),
    (meta("a", "r1", group={"port": 7}), 3, "whose 'group' is {'port': 7}, not a GroupKey "
                                            "(port, members) or None"),
    ({**meta("a", "s1"), "zmq_ip": "x"}, 1, "with the unknown key 'zmq_ip'"),
    (meta("", "r1"), 3, "whose 'host' is '', not a non-empty string"),
])
def test_broadcast_metadata_that_lies_is_refused_naming_the_process(lie, index, problem):
    from weightsync_core.api.errors import MetadataError

    metadata = [meta("a", "s0"), meta("a", "s1"), meta("b", "r0"), meta("c", "r1")]
    metadata[index] = lie
    with pytest.raises(MetadataError) as info:
        broadcast_topology(2, 2, metadata)
    assert info.value.index == index and info.value.problem.startswith(problem)
    name = ["actor rank 0", "actor rank 1", "rollout rank 0", "rollout rank 1"][index]
    assert str(info.value).startswith(f"{name} returned metadata {problem}")


def test_a_ring_worker_without_its_endpoint_is_refused_naming_it():
    from weightsync_core.api.errors import MetadataError

    metadata = [{"endpoint": "tcp://h:0"}, {"endpoint": "tcp://h:1"}, {"peer": "x"}]
    with pytest.raises(MetadataError, match=r"^rollout rank 1 returned metadata without "
                                            r"'endpoint' \(it holds 'peer'\) from prepare\(\)"):
        ring_topology(1, 2, metadata)
    with pytest.raises(MetadataError, match="rollout rank 0 returned metadata that is not a "
                                            "dict but NoneType None"):
        ring_topology(1, 2, [{"endpoint": "tcp://h:0"}, None, {"endpoint": "tcp://h:2"}])
