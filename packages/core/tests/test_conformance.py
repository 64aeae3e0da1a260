"""The conformance suite, run for core's own engines."""

from weightsync_core.testing import (
    CheckpointEngineConformanceTests,
    ColocatedEngineConformanceTests,
)


class TestGlooConformance(CheckpointEngineConformanceTests):
    backend = "gloo"


class TestNaiveConformance(ColocatedEngineConformanceTests):
    backend = "naive"


class TestGlooRelayConformance(CheckpointEngineConformanceTests):
    """Both actor ranks send (rank 0 and a relay on its host), each to its share. The
    failure, security and soak cases exercise the same code as without relays (above), so
    they run once, there."""

    backend = "gloo"
    engine_kwargs = {"senders": 2}  # noqa: RUF012

    test_stalled_receiver_is_blamed_within_the_timeout = None
    test_frozen_receiver_is_blamed_within_the_timeout = None
    test_slow_receiver_past_the_timeout_is_blamed = None
    test_sender_that_dies_is_blamed = None
    test_outsider_can_neither_run_code_nor_join_and_syncs_stay_exact = None
    test_soak_keeps_resources_flat_and_close_frees_every_port = None
