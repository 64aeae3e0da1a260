"""The conformance suite, run for core's own engines."""

import pytest

from weightsync_core.api.passes import passes_in
from weightsync_core.testing import (
    AdapterSyncConformanceTests,
    CheckpointEngineConformanceTests,
    ColocatedEngineConformanceTests,
    ConnectionStormTests,
    DeltaSyncConformanceTests,
    ShardedDeliveryConformanceTests,
)
from weightsync_core.testing.harness import SyncHarness


class TestGlooConformance(CheckpointEngineConformanceTests, DeltaSyncConformanceTests,
                          AdapterSyncConformanceTests, ConnectionStormTests):
    backend = "gloo"

    def test_a_sync_reports_the_time_of_each_pass_over_the_bytes(self, harness: SyncHarness):
        harness.set_weights(seed=70)
        metrics = harness.manager().update_weights_sync(global_steps=70)
        passes = set(passes_in(metrics))
        assert {"cast", "pack", "receive", "receiver_checksum"} <= passes
        assert all(metrics[f"weightsync/passes/{name}"] >= 0.0 for name in passes)
        assert metrics["weightsync/passes/receive"] > 0.0


class TestNaiveConformance(ColocatedEngineConformanceTests):
    backend = "naive"


class TestGlooRelayConformance(CheckpointEngineConformanceTests):
    """Both actor ranks send (rank 0 and a relay on its host), each to its share. The
    failure, security and soak cases exercise the same code as without relays (above), so
    they run once, there; so do the checks of the sender's input, which rank 0 makes before
    any byte reaches a relay."""

    backend = "gloo"
    engine_kwargs = {"senders": 2}  # noqa: RUF012

    _ONCE_WITHOUT_RELAYS = ("exercises the same code as without relays; runs once, in "
                            "TestGlooConformance")
    skipped_cases = {  # noqa: RUF012
        "test_stalled_receiver_is_blamed_within_the_timeout": _ONCE_WITHOUT_RELAYS,
        "test_frozen_receiver_is_blamed_within_the_timeout": _ONCE_WITHOUT_RELAYS,
        "test_slow_receiver_past_the_timeout_is_blamed": _ONCE_WITHOUT_RELAYS,
        "test_sender_that_dies_is_blamed": _ONCE_WITHOUT_RELAYS,
        "test_outsider_can_neither_run_code_nor_join_and_syncs_stay_exact":
            _ONCE_WITHOUT_RELAYS,
        "test_soak_keeps_resources_flat_and_close_frees_every_port": _ONCE_WITHOUT_RELAYS,
        "test_flood_of_junk_at_every_port_costs_bounded_memory_and_time": _ONCE_WITHOUT_RELAYS,
        "test_duplicate_names_are_refused": _ONCE_WITHOUT_RELAYS,
        "test_non_tensor_values_are_refused": _ONCE_WITHOUT_RELAYS,
    }


def test_a_case_switched_off_without_a_reason_is_refused():
    with pytest.raises(TypeError, match=r"test_sender_that_dies_is_blamed = None .*skipped_cases"):
        type("Silent", (CheckpointEngineConformanceTests,), {
            "backend": "gloo", "test_sender_that_dies_is_blamed": None})
    with pytest.raises(TypeError, match="'test_no_such_case', which is not a case"):
        type("Misspelt", (CheckpointEngineConformanceTests,), {
            "backend": "gloo", "skipped_cases": {"test_no_such_case": "why"}})
    with pytest.raises(TypeError, match="must give the reason"):
        type("Reasonless", (CheckpointEngineConformanceTests,), {
            "backend": "gloo", "skipped_cases": {"test_sender_that_dies_is_blamed": " "}})


def test_skipped_cases_are_pytest_skips_with_their_reason():
    case = TestGlooRelayConformance.test_sender_that_dies_is_blamed
    [mark] = [mark for mark in case.pytestmark if mark.name == "skip"]
    assert mark.kwargs["reason"] == TestGlooRelayConformance._ONCE_WITHOUT_RELAYS
    # the case runs unskipped where it is not listed
    assert not hasattr(TestGlooConformance.test_sender_that_dies_is_blamed, "pytestmark")


class TestShardedGlooConformance(CheckpointEngineConformanceTests,
                                 ShardedDeliveryConformanceTests, ConnectionStormTests):
    """Sharded delivery over gloo point to point; small chunks, so the embedding's pieces
    travel in several."""

    backend = "gloo_sharded"
    engine_kwargs = {"chunk_megabytes": 0.004}  # noqa: RUF012
    soak_syncs = 100  # a group is built every sync: a leak per sync shows after 100 as well
    storm_syncs = 10  # each sync's sealed store and gloo group churned from when they listen

    _NO_PORT_BETWEEN_SYNCS = (
        "gloo_sharded builds its group afresh every sync and listens only during one (its "
        "store from prepare to init_process_group, gloo's pairs until finalize): between "
        "syncs there is no port to attack. Its store is gloo's sealed store, and a piece's "
        "checksum is sealed under the sync's key (test_shards_exchange.py: a forged one is "
        "refused)")
    skipped_cases = {  # noqa: RUF012
        "test_outsider_can_neither_run_code_nor_join_and_syncs_stay_exact":
            _NO_PORT_BETWEEN_SYNCS,
        "test_flood_of_junk_at_every_port_costs_bounded_memory_and_time":
            _NO_PORT_BETWEEN_SYNCS,
    }
