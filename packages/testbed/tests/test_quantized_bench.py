"""The quantize-on-send benchmark across the link (``weightsync-testbed quantized``): bf16,
fp8_block and fp8_block delta syncs from an actor host to a replica host, each mode on
processes of its own; what the FP8 syncs carried over the replica host's NIC."""

from __future__ import annotations

from weightsync_core.bench.quantized import run_quantized_benchmark
from weightsync_testbed import HostPlacement

MIB = 2**20


def test_fp8_syncs_carry_half_the_bytes_of_bf16_across_the_link(testbed):
    before = testbed.nic_bytes("r0")
    result = run_quantized_benchmark("gloo", {}, size_megabytes=16, num_tensors=2, repeats=1,
                                     bucket_megabytes=4,
                                     placement=HostPlacement(actors=["a0"], replicas=["r0"]))
    carried = (testbed.nic_bytes("r0") - before).received
    bf16, fp8, delta = (result.row(mode) for mode in ("bf16", "fp8_block", "fp8_block delta"))
    assert 1.99 < bf16.wire_bytes / fp8.wire_bytes < 2.0  # 1 byte an element, 4 a block
    assert 0.0 < delta.changed_fraction < 1.0 and delta.wire_bytes < fp8.wire_bytes / 10
    # every sync crossed r0's NIC (each mode's warm-up and timed one; the delta mode's
    # warm-up is a full FP8 sync), with the frames' headers and Ray's own traffic beside
    sent = 2 * bf16.wire_bytes + 3 * fp8.wire_bytes + delta.wire_bytes
    assert sent <= carried < 1.1 * sent + 8 * MIB, (carried, sent)
