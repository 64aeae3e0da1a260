"""The stall summary of a generating client: token times against sync windows."""

import pytest

from weightsync_core.bench.stall import SyncWindow, summarize_stalls


def test_a_sync_that_blocks_the_stream_shows_its_gap_beyond_the_usual_one():
    # a token every 10 ms from 0 to 1 s, except a 300 ms hole in the stop-the-world sync
    # (from 0.5 s) and one 30 ms gap in the staged sync (from 0.2 s)
    times = [t / 100 for t in range(101) if not 50 < t < 80 and t != 22 and t != 23]
    windows = [SyncWindow(0.18, 0.26, "staged", 0.005),
               SyncWindow(0.45, 0.85, "stop-the-world")]
    summaries, usual, rate = summarize_stalls([times], windows)
    assert usual == pytest.approx(0.01)
    assert summaries["staged"].stall_seconds == [pytest.approx(0.02)]
    assert summaries["stop-the-world"].stall_seconds == [pytest.approx(0.29)]
    assert summaries["staged"].pause_seconds == [0.005]
    assert summaries["stop-the-world"].pause_seconds == []
    # between syncs: 100 tokens per second; during the stop-the-world sync far fewer
    assert rate == pytest.approx(100, rel=0.1)
    assert summaries["stop-the-world"].tokens_per_second_during < 0.5 * rate


def test_no_token_between_syncs_is_refused():
    with pytest.raises(ValueError, match="outside the syncs"):
        summarize_stalls([[0.1, 0.2]], [SyncWindow(0.0, 1.0, "staged")])
