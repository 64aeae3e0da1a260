"""The cost model's inputs on the testbed: the probe sees the shaped links; every cell of
the benchmark matrix gets a prediction, printed beside the measurement."""

from __future__ import annotations

import json

import pytest

from weightsync_core.cli import main
from weightsync_core.plan import EngineCosts, Link, measure_link
from weightsync_testbed.bench import BenchCell, BenchReport
from weightsync_testbed.placement import on_host
from weightsync_testbed.prediction import CellModel, fit_engine_costs

MODEL = CellModel(Link(119.5e6, 20e-6), Link(3e9, 5e-6), 256 << 20, 64 << 20, cpu_cores=2)


def test_probe_between_hosts_sees_the_shaped_link(testbed):
    link = measure_link(on_host("a0"), on_host("r0"), nbytes=32 << 20)
    # 1 Gbit/s of frames carries about 0.956 Gbit/s of TCP payload (1448 of 1514 bytes)
    assert 0.85e9 < link.bandwidth * 8 < 1.0e9
    inside = measure_link(on_host("r0"), on_host("r0"), nbytes=32 << 20)
    assert inside.bandwidth > 2 * link.bandwidth  # loopback inside a host is not shaped


def test_plan_measure_probes_the_connected_cluster(testbed, capsys):
    assert main(["plan", "--measure", "--model-gb", "0.5", "--replicas", "2",
                 "--bucket-mb", "64", "gloo", "mooncake"]) == 0
    out = capsys.readouterr().out
    measured = float(out.split("measured: NIC ")[1].split(" Gbit/s")[0])
    assert 0.85 < measured < 1.0  # two nodes of the testbed: a shaped 1 Gbit/s link
    assert "recommended: mooncake (ring)" in out


@pytest.mark.parametrize("method", ["gloo", "nixl", "mooncake", "kimi", "raw nixl write",
                                    "raw mooncake write", "raw gloo broadcast",
                                    "Ray object store"])
def test_every_benchmarked_method_has_a_prediction(method):
    one = MODEL.predict(method, 1)
    assert one is not None and one.seconds >= (256 << 20) / 119.5e6
    if not method.startswith("raw") or method == "raw gloo broadcast":
        assert MODEL.predict(method, 4).seconds > one.seconds


def test_fan_out_baselines_scale_with_receivers_and_rings_with_hops():
    broadcast = [MODEL.predict("raw gloo broadcast", n).seconds for n in (1, 2, 4)]
    assert broadcast[1] == pytest.approx(2 * broadcast[0], rel=1e-3)
    assert broadcast[2] == pytest.approx(4 * broadcast[0], rel=1e-3)
    ring = MODEL.predict("mooncake", 4)
    assert len(ring.stages) == 4 and ring.buckets == 4


def test_report_prints_prediction_and_error_beside_each_cell():
    report = BenchReport("1gbit", 256 << 20, 64, 3, 0.956e9, 2e-5)
    report.cells = [BenchCell("gloo", 1, 2.0, 256 << 20, 1e9, predicted=2.2),
                    BenchCell("gloo", 2, 4.0, 256 << 20, 1e9, predicted=3.6)]
    table = report.markdown()
    assert "(2.20 s, +10%)" in table and "(3.60 s, -10%)" in table
    assert "Largest prediction error: 10% over 2 backend cells." in table
    assert "0.956 Gbit/s of payload" in table


def test_fit_recovers_the_costs_that_produced_the_times():
    truth = {"nixl": EngineCosts(per_bucket=0.03, per_byte=2e-9), "gloo": EngineCosts(0.02)}
    samples = []
    for bucket_mb in (8, 64):
        model = CellModel(MODEL.nic, MODEL.intra_host, MODEL.nbytes, bucket_mb << 20, 2)
        for backend in truth:
            samples.append((model, backend, model.predict(backend, 1, truth).seconds))
    fitted = fit_engine_costs(samples)
    assert fitted["nixl"].per_bucket == pytest.approx(0.03)
    assert fitted["nixl"].per_byte == pytest.approx(2e-9)
    assert fitted["gloo"].per_bucket == pytest.approx(0.02)
    assert fitted["gloo"].per_byte == pytest.approx(0.0, abs=1e-15)


def test_saved_run_round_trips_and_is_predicted_again():
    report = BenchReport("1gbit", 256 << 20, 64, 3, 0.956e9, 2e-5, 26e9, cpu_cores=2)
    report.cells = [BenchCell("mooncake", 2, 3.0, 256 << 20, 1e9)]
    again = BenchReport.from_dict(json.loads(json.dumps(report.as_dict())))
    assert again.cells[0].predicted is None
    again.predict()
    assert again.cells[0].predicted == pytest.approx(MODEL.predict("mooncake", 2).seconds,
                                                     rel=0.01)
    assert again.cells[0].bound
