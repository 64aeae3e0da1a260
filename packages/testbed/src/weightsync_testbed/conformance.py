"""Running a backend's conformance suite across emulated hosts.

Example, in a test module (with a session testbed whose hosts include the placement's)::

    class TestNixlAcrossHosts(AcrossHosts, CheckpointEngineConformanceTests):
        backend = "nixl"
        engine_kwargs = {"device": "cpu", "ucx_transports": "tcp"}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from weightsync_core.testing import SyncHarness
from weightsync_testbed.placement import HostPlacement

__all__ = ["STANDARD_PLACEMENT", "AcrossHosts"]

STANDARD_PLACEMENT = HostPlacement(actors=["a0", "a1"], replicas=["r0", "r1", "r2"])
"""Actor ranks on two hosts; each replica on a host of its own (three replica hosts, so that
the suite's extra replicas also land apart)."""


class AcrossHosts:
    """Mixin for a conformance test class: its deployment is placed by ``placement``.

    Left out across hosts, because each backend runs them on loopback and nothing in them
    depends on where a process runs: the outsider test (it attacks from the driver's own
    loopback), the 200-sync soak, and the stalled, frozen, slow-receiver and dying-sender
    cases (faults of a process, not of a network: a killed receiver and a replica added on a
    new host stay in; :mod:`weightsync_testbed` tests network faults of its own).
    """

    placement: ClassVar[HostPlacement] = STANDARD_PLACEMENT

    @classmethod
    def make_harness(cls: Any) -> SyncHarness:
        """The suite's deployment, placed on the testbed's hosts."""
        return SyncHarness(cls.make_config(), cls.actor_world_size, cls.replica_sizes,
                           cls.ray_actor_options, placement=cls.placement)

    skipped_cases: ClassVar[Mapping[str, str]] = {
        "test_outsider_can_neither_run_code_nor_join_and_syncs_stay_exact":
            "attacks from the driver's own loopback: runs in each backend's own tests",
        "test_flood_of_junk_at_every_port_costs_bounded_memory_and_time":
            "floods from the driver's own loopback: runs in each backend's own tests",
        "test_soak_keeps_resources_flat_and_close_frees_every_port":
            "leaks do not depend on where a process runs: runs in each backend's own tests",
        "test_stalled_receiver_is_blamed_within_the_timeout":
            "a fault of a process, not of the network: runs in each backend's own tests",
        "test_frozen_receiver_is_blamed_within_the_timeout":
            "a fault of a process, not of the network: runs in each backend's own tests",
        "test_slow_receiver_past_the_timeout_is_blamed":
            "a fault of a process, not of the network: runs in each backend's own tests",
        "test_sender_that_dies_is_blamed":
            "a fault of a process, not of the network: runs in each backend's own tests",
    }
    """The suite's cases left out across hosts, with the reason (see above)."""
