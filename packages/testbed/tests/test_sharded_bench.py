"""Sharded delivery across hosts, each process on a host of its own: each TP worker
receives only its half, and the NICs carry what the plan says, not a full copy."""

from __future__ import annotations

import pytest

from weightsync_testbed import SpreadPlacement
from weightsync_testbed.sharded_bench import ShardedReport, measure_cell

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
    assert f"| {method} | {SIZE * worker_share / MIB:.0f} MiB |" in report.markdown()
