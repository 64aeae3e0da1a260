"""The cost model on cases computed by hand, the planner's ranking, and the CLI."""

from __future__ import annotations

import json

import pytest

from weightsync_core.cli import main
from weightsync_core.plan import (
    Cluster,
    EngineCosts,
    Link,
    Stage,
    Workload,
    chained_broadcast,
    fan_out,
    pipeline,
    plan,
    ring,
    sharded_delivery,
    sharded_plan,
    sharded_pull,
)

NIC = Link(bandwidth=100.0, latency=0.5)  # 100 bytes/s: a 100-byte bucket takes 1 s + 0.5 s
FAST = Link(bandwidth=1000.0)


def cluster(**layout) -> Cluster:
    return Cluster(NIC, FAST, **layout)


def test_one_hop_is_latency_plus_bytes_over_bandwidth_per_bucket():
    one = ring("nixl", cluster(), Workload(100, 100), EngineCosts())
    assert one.seconds == pytest.approx(1.5)
    assert one.buckets == 1
    four = ring("nixl", cluster(), Workload(400, 100), EngineCosts())
    assert four.seconds == pytest.approx(4 * 1.5)
    assert four.bound == "NIC hop actor host 0 -> rollout host 0"


def test_ring_of_n_hosts_takes_buckets_plus_hops_minus_one_stages():
    for hosts in (1, 2, 5):
        predicted = ring("mooncake", cluster(replicas=hosts), Workload(800, 100), EngineCosts())
        assert len(predicted.stages) == hosts
        assert predicted.seconds == pytest.approx((8 + hosts - 1) * 1.5)
    assert predicted.bound == "NIC hop actor host 0 -> rollout host 0 (and 4 more as slow)"


def test_ring_hops_inside_a_host_take_the_intra_host_link():
    two_per_host = cluster(replicas=2, rollout_workers_per_host=2)
    predicted = ring("nixl", two_per_host, Workload(300, 100), EngineCosts())
    assert [s.seconds for s in predicted.stages] == pytest.approx([1.5, 0.1])
    assert predicted.seconds == pytest.approx(1.5 + 0.1 + 2 * 1.5)


def test_engine_cost_per_bucket_stretches_with_processes_over_shared_cores():
    costs = EngineCosts(per_bucket=0.5, per_byte=0.01)
    alone = ring("nixl", cluster(replicas=3), Workload(400, 100), costs)
    shared = ring("nixl", cluster(replicas=3, shared_cpu_cores=2), Workload(400, 100), costs)
    assert alone.stages[0].seconds == pytest.approx(1.5 + 0.5 + 1.0)
    assert shared.stages[0].seconds == pytest.approx(1.5 + 0.5 * 4 / 2 + 1.0)  # 4 processes
    assert shared.seconds == pytest.approx((4 + 3 - 1) * 3.5)


def test_fan_out_sends_one_copy_per_receiver_over_the_senders_uplink():
    for receivers in (1, 3):
        predicted = fan_out("gloo", cluster(replicas=receivers), Workload(200, 100),
                            EngineCosts())
        assert predicted.seconds == pytest.approx(2 * (0.5 + receivers * 1.0))
        assert f"({receivers} cop{'y' if receivers == 1 else 'ies'} a bucket)" in predicted.bound
    # relays share actor host 0's NIC: more senders, same copies on it
    relayed = fan_out("gloo", cluster(replicas=3, actor_ranks_per_host=3),
                      Workload(200, 100), EngineCosts(), senders=3)
    assert relayed.seconds == pytest.approx(2 * (0.5 + 3.0))


def test_chained_broadcast_carries_one_copy_per_group_through_each_nic():
    # 4 hosts in a chain: the bucket (100 bytes, 1 s a copy) streams in chunks (here the
    # whole bucket, smaller than NCCL's chunk) so the last host gets it 3 chunk times and
    # 4 latencies after the first byte left
    one_group = chained_broadcast("nccl", cluster(replicas=4), Workload(1000, 100),
                                  EngineCosts())
    assert one_group.seconds == pytest.approx(10 * (1.0 + 3 * 1.0 + 4 * 0.5))
    assert "(1 copy a bucket)" in one_group.bound
    two_groups = chained_broadcast("nccl", cluster(replicas=4, actor_ranks_per_host=2),
                                   Workload(1000, 100), EngineCosts(), senders=2)
    assert "(2 copies a bucket)" in two_groups.bound
    assert two_groups.stages[0].seconds == pytest.approx(2.0 + 1 * 1.0 + 2 * 0.5)


def test_pull_and_relay_is_a_two_level_tree():
    # 2 replicas of 3 workers, a replica per host: leaders pull each bucket (2 copies on the
    # owner's uplink, 0.5 + 2 s), then fan it out to 2 members over the intra-host link
    # (2 x 0.1 s); pipelined over 4 buckets
    tree = cluster(replicas=2, workers_per_replica=3, rollout_workers_per_host=3)
    predicted = sharded_pull("kimi", tree, Workload(400, 100), EngineCosts())
    assert [s.seconds for s in predicted.stages] == pytest.approx([2.5, 0.2])
    assert predicted.seconds == pytest.approx(2.5 + 0.2 + 3 * 2.5)
    assert "2 leader(s) pull each bucket" in predicted.bound


def test_kimi_relay_counts_the_slowest_replica_and_depth_binds_its_two_stages():
    # replicas of 3 workers on hosts of 2: replica 1's leader (host 1) relays to two
    # workers on host 2, both over its NIC (0.5 + 2 x 1 s); replica 0 sends one copy over
    # its NIC and one inside its host (0.5 + 1 + 0.1 s)
    spanning = cluster(replicas=2, workers_per_replica=3, rollout_workers_per_host=2)
    predicted = sharded_pull("kimi", spanning, Workload(400, 100), EngineCosts())
    assert [s.seconds for s in predicted.stages] == pytest.approx([2.5, 2.5])
    one_slot = sharded_pull("kimi", spanning, Workload(400, 100, pipeline_depth=1),
                            EngineCosts())
    assert one_slot.seconds == pytest.approx(5.0 + 3 * 5.0)
    assert one_slot.bound.startswith("pipeline depth 1")


def test_one_bucket_through_one_stage_names_the_stage():
    single = fan_out("gloo", cluster(replicas=2), Workload(100, 100), EngineCosts())
    assert single.bound == "actor host 0 NIC uplink (2 copies a bucket)"


def test_pipeline_depth_caps_the_overlap():
    stages = [Stage("a", 1.0), Stage("b", 1.0), Stage("c", 1.0)]
    assert pipeline("x", "y", stages, 5, depth=3).seconds == pytest.approx(3 + 4 * 1.0)
    limited = pipeline("x", "y", stages, 5, depth=2)
    assert limited.seconds == pytest.approx(3 + 4 * 1.5)
    assert limited.bound.startswith("pipeline depth 2")
    assert pipeline("x", "y", stages, 1, depth=3).bound.startswith("pipeline fill")


def test_plan_ranks_every_option_fastest_first_and_names_the_bound():
    gpus = Cluster(Link(50e9, 5e-6), Link(450e9, 2e-6), replicas=4, actor_ranks_per_host=2)
    free = {"gloo": EngineCosts(), "nccl": EngineCosts()}
    ranked = plan(gpus, Workload(100 << 30, 1 << 30), "gpu", costs=free)
    seconds = [item.prediction.seconds for item in ranked]
    assert seconds == sorted(seconds)
    found = {(item.prediction.backend, item.prediction.option): item for item in ranked}
    assert {("nccl", "broadcast"), ("nccl", "broadcast, 2 senders"), ("nixl", "ring"),
            ("kimi", "pull + nccl relay"), ("gloo", "broadcast")} <= set(found)
    nccl, gloo = found["nccl", "broadcast"].prediction, found["gloo", "broadcast"].prediction
    assert 3.9 < gloo.seconds / nccl.seconds <= 4  # 4 copies through one uplink, not 1
    assert gloo.bound == "actor host 0 NIC uplink (4 copies a bucket)"
    assert found["nccl", "broadcast, 2 senders"].engine_kwargs == {"senders": 2}


def test_unknown_backend_and_bad_layout_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="naive do not run on device 'cpu'"):
        plan(cluster(), Workload(100, 100), backends=["naive"])
    with pytest.raises(ValueError, match="nccl do not run on device 'cpu'; on it: gloo, nixl"):
        plan(cluster(), Workload(100, 100), backends=["nccl"])
    with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
        cluster(replicas=0)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        Link(0)
    with pytest.raises(ValueError, match="device must be one of cpu, gpu, npu"):
        plan(cluster(), Workload(100, 100), device="tpu")


def test_receiver_memory_counts_buffers_and_a_merged_tensor():
    assert Workload(1000, 100, largest_tensor_bytes=300).receiver_memory_bytes == 500
    assert Workload(1000, 100, largest_tensor_bytes=50).receiver_memory_bytes == 200


def test_cli_prints_a_ranked_table_and_json(capsys):
    argv = ["plan", "--model-gb", "1", "--replicas", "2", "--nic-gbit", "10", "--bucket-mb",
            "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| 1 |" in out and "recommended:" in out
    assert main([*argv, "--json", "gloo"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["backend"] for row in rows] == ["gloo"]
    assert rows[0]["seconds"] > 2 * 8 / 10  # two copies of 1 GB over 10 Gbit/s


def test_nccl_spreads_a_broadcast_over_every_nic_of_a_host():
    one = chained_broadcast("nccl", cluster(replicas=4), Workload(1000, 100), EngineCosts())
    four = chained_broadcast("nccl", cluster(replicas=4, nics_per_host=4), Workload(1000, 100),
                             EngineCosts())
    # the copy's wire time (1 s of each 6 s a bucket) over 4 NICs; the chain's fill is not
    assert four.seconds == pytest.approx(one.seconds - 10 * 0.75)
    assert "over its 4 NICs" in four.bound
    # the ring sends from one process a hop: one NIC each, however many the host has
    assert ring("nixl", cluster(replicas=2, nics_per_host=4), Workload(1000, 100),
                EngineCosts()).seconds == ring("nixl", cluster(replicas=2), Workload(1000, 100),
                                               EngineCosts()).seconds
    with pytest.raises(ValueError, match="nics_per_host must be an integer >= 1"):
        cluster(nics_per_host=0)


def test_sharded_delivery_sends_each_worker_its_shard_from_every_actor_rank():
    # 2 actor hosts of 2 ranks -> 2 replicas of TP=2, a worker a host, a NIC a host: each
    # worker needs half of 1000 bytes; the actor side sends the 2000 bytes all 4 need, 1000
    # over each actor host's one NIC: the busier end (10 buckets of 100 bytes at 1.5 s)
    layout = {"actor_hosts": 2, "actor_ranks_per_host": 2, "replicas": 2,
              "workers_per_replica": 2}
    prediction = sharded_delivery("nixl", cluster(**layout), Workload(1000, 100), EngineCosts())
    assert prediction.bound == "actor host NIC uplinks (1e-06 GB each)"
    assert prediction.seconds == pytest.approx(10 * 1.5)
    # a NIC per process: each actor rank's 500 bytes over its own NIC, as fast as a worker's
    fast = sharded_delivery("nixl", cluster(**layout, nics_per_host=2), Workload(1000, 100),
                            EngineCosts())
    assert fast.seconds == pytest.approx(5 * 1.5)
    # norms and replicated heads every worker needs whole: a quarter of the model
    replicated = sharded_delivery("nixl", cluster(**layout, nics_per_host=2),
                                  Workload(1000, 100), EngineCosts(), replicated_fraction=0.25)
    # 625 bytes a worker: 7 buckets, each a latency, 6.25 s of wire in all
    assert replicated.seconds == pytest.approx(7 * 0.5 + 6.25)
    with pytest.raises(ValueError, match="replicated_fraction must be within"):
        sharded_delivery("nixl", cluster(), Workload(1000, 100), EngineCosts(), 1.5)


def test_relays_between_replicas_halve_the_actor_uplinks_for_a_second_hop():
    # as above, relayed: the actor ranks send the model once (500 bytes per actor host, as
    # much as a worker receives: 5 buckets at 1.5 s); each worker forwards 250 bytes to its
    # peer in the other replica (a second hop of 1 s a bucket)
    layout = {"actor_hosts": 2, "actor_ranks_per_host": 2, "replicas": 2,
              "workers_per_replica": 2}
    relayed = sharded_delivery("nixl", cluster(**layout), Workload(1000, 100), EngineCosts(),
                               relay=True)
    assert relayed.option == "sharded delivery, relayed between replicas"
    assert [stage.seconds for stage in relayed.stages] == pytest.approx([1.5, 1.0])
    assert relayed.seconds == pytest.approx(1.5 + 1.0 + 4 * 1.5)
    # the planner takes the faster of the two; one replica has nothing to relay
    assert sharded_plan(cluster(**layout), Workload(1000, 100)).option == relayed.option
    single = {**layout, "replicas": 1}
    assert sharded_plan(cluster(**single), Workload(1000, 100)).option == "sharded delivery"


def test_the_1t_case_with_8_nics_a_host_is_bound_by_the_rollout_downlinks():
    """1 TB (FP8) from 256 trainer GPUs (32 hosts of 8) into 8 replicas of 16 GPUs (16 hosts
    of 8), 8 NICs of 400 Gbit/s a host: Perplexity publishes 1.3 s."""
    cluster_1t = Cluster(Link(50e9, 5e-6), Link(450e9, 2e-6), actor_hosts=32,
                         actor_ranks_per_host=8, replicas=8, workers_per_replica=16,
                         rollout_workers_per_host=8, nics_per_host=8)
    prediction = sharded_plan(cluster_1t, Workload(int(1000e9), 1 << 30), device="gpu")
    assert prediction.seconds == pytest.approx(1.31, abs=0.01)
    assert prediction.bound == "rollout host NIC downlinks (62.5 GB each)"


def test_cli_predicts_sharded_delivery_beside_the_table(capsys):
    argv = ["plan", "--model-gb", "1", "--replicas", "2", "--workers-per-replica", "2",
            "--actor-ranks-per-host", "2", "--nics-per-host", "2", "--sharded"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # 2 replicas of the same shards: relays between them win
    assert "sharded delivery, relayed between replicas (each rollout worker its shard from " \
        "every actor rank; nixl_sharded / mooncake_sharded write it, gloo_sharded sends it " \
        "over gloo)" in out
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[-1]["option"].startswith("sharded delivery")
    assert rows[-1]["engine_kwargs"] is None
