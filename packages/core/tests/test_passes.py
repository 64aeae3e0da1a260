"""The passes a sync's processes time: kept per pass, reported as figures, gathered by the
manager as the longest any process spent; an engine that times none reports none."""

import threading

from weightsync_core.api.passes import PassTimes, pass_metrics, passes_in, passes_of
from weightsync_core.engines.gloo import GlooCheckpointEngine


def test_passes_add_up_from_every_thread_and_clear_for_the_next_sync():
    passes = PassTimes()
    threads = [threading.Thread(target=lambda: [passes.add("pack", 0.001) for _ in range(1000)])
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with passes.timed("write"):
        pass
    figures = passes.as_dict()
    assert set(figures) == {"pass_pack_seconds", "pass_write_seconds"}
    assert abs(figures["pass_pack_seconds"] - 4.0) < 1e-6
    passes.clear()
    assert passes.as_dict() == {}


def test_the_manager_reports_the_longest_any_process_spent_in_each_pass():
    reports = [{"pass_pack_seconds": 0.5, "nbytes": 10}, {"pass_pack_seconds": 0.2,
                                                         "pass_write_seconds": 0.3}]
    metrics = pass_metrics(reports)
    assert metrics == {"weightsync/passes/pack": 0.5, "weightsync/passes/write": 0.3}
    assert passes_in({**metrics, "weightsync/bytes": 10.0}) == {"pack": 0.5, "write": 0.3}


def test_an_engine_times_its_passes_and_a_foreign_one_reports_none():
    engine = GlooCheckpointEngine(1 << 20)
    assert passes_of(engine) is engine.passes
    foreign = passes_of(object())  # verl's own engine, say
    foreign.add("load", 1.0)
    assert foreign.as_dict() == {}
