"""Sharded delivery across hosts, each process on a host of its own: each TP worker
receives only its half, workers of two replicas relay to each other, and the NICs carry what
the plan says, not a full copy."""

from __future__ import annotations

import pytest

from weightsync_testbed import SpreadPlacement
from weightsync_testbed.sharded_bench import ShardedReport, is_sharded, measure_cell

MIB = 2**20
SIZE = 8 * MIB
PLACEMENT = SpreadPlacement(actors=["a0", "a1"], workers=["r0", "r1"], workers_per_replica=2)


@pytest.mark.parametrize(("method", "worker_share"), [("nixl_sharded", 0.5), ("nixl", 1.0)])
def test_each_worker_host_receives_its_share_and_each_actor_host_sends_its_rows(
    testbed, method, worker_share
):
    cell = measure_cell(testbed, method, actors=2, tp=2, replicas=1, placement=PLACEMENT,
                        nbytes=SIZE, bucket_megabytes=4, repeats=1)

    assert cell.worker_bytes == SIZE * worker_share
    # every worker's NIC carried its share once (plus control traffic), on its own host
    for received in cell.worker_nic_received:
        assert SIZE * worker_share <= received < SIZE * worker_share + MIB, cell
    if method == "nixl_sharded":
        # each FSDP rank's rows are exactly one worker's rows: each actor host sends half
        for sent in cell.actor_nic_sent:
            assert SIZE / 2 <= sent < SIZE / 2 + MIB, cell
    report = ShardedReport("1gbit", SIZE, 4, 1, cells=[cell])
    assert f"| {method} | {SIZE * worker_share / MIB:.1f} MiB |" in report.markdown()


@pytest.mark.parametrize("relay", [True, False])
def test_replicas_relay_so_the_actor_hosts_send_the_model_once(testbed, relay):
    """2 actor hosts (half the rows each) into 2 one-worker replicas, each on a host of its
    own: relayed, each actor host sends its half once and the two workers forward about
    half the model each to the other; direct, each actor host sends its half twice."""
    placement = SpreadPlacement(actors=["a0", "a1"], workers=["r0", "r1"],
                                workers_per_replica=1)
    cell = measure_cell(testbed, "nixl_sharded", actors=2, tp=1, replicas=2,
                        placement=placement, nbytes=SIZE, bucket_megabytes=4, repeats=1,
                        relay=relay)

    assert cell.worker_bytes == SIZE
    for received in cell.worker_nic_received:
        assert SIZE <= received < SIZE + MIB, cell
    copies = 1 if relay else 2
    for sent in cell.actor_nic_sent:
        assert copies * SIZE / 2 <= sent < copies * SIZE / 2 + MIB, cell
    if relay:
        assert SIZE <= sum(cell.worker_nic_sent) < SIZE + 2 * MIB, cell
        assert all(SIZE / 4 < sent < 3 * SIZE / 4 for sent in cell.worker_nic_sent), cell
    else:
        assert all(sent < MIB for sent in cell.worker_nic_sent), cell


def test_a_delta_sync_of_slices_carries_a_small_part_of_a_full_one(testbed):
    """2% of every tensor changed on each FSDP rank: each TP worker's NIC carries patches of
    its half (float32: positions and values, about 4% of it), the actor hosts' NICs as
    little, where the full sync of the cell before carried the half whole."""
    cell = measure_cell(testbed, "nixl_sharded", actors=2, tp=2, replicas=1,
                        placement=PLACEMENT, nbytes=SIZE, bucket_megabytes=4, repeats=1,
                        changed_fraction=0.02)

    half = SIZE / 2
    assert all(0.03 * half < received < 0.1 * half for received in cell.worker_nic_received
               ), cell
    assert all(sent < 0.1 * half for sent in cell.actor_nic_sent), cell
    assert cell.diff_seconds is not None and cell.diff_seconds > 0, cell


def test_a_sharded_method_is_read_with_its_bucket_and_relay_mode():
    assert is_sharded("nixl_sharded:8+direct") and is_sharded("gloo_sharded")
    assert is_sharded("nixl_sharded+direct+delta")
    assert not is_sharded("mooncake:8") and not is_sharded("nixl+delta")
    with pytest.raises(ValueError, match=r"only a sharded backend takes '\+direct'"):
        is_sharded("nixl+direct")
    with pytest.raises(ValueError, match=r"no mode 'fast'"):
        is_sharded("nixl_sharded+fast")
