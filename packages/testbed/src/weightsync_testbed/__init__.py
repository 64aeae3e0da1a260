"""weightsync-testbed: an emulated multi-host Ray cluster on one machine.

Network namespaces joined by veth pairs to a bridge, each link shaped with ``tbf`` to a
chosen line rate, a Ray node per emulated host, fault verbs (link down, loss, partition,
delay) and placement helpers, so that weightsync's engines are tested and benchmarked
across host boundaries. Needs root and iproute2; see :func:`check_available`.
"""

from weightsync_testbed.claim import TestbedBusyError
from weightsync_testbed.cluster import host_resource
from weightsync_testbed.network import Link, TestbedUnavailableError, check_available
from weightsync_testbed.placement import HostPlacement, SpreadPlacement, on_host
from weightsync_testbed.testbed import Testbed, cleanup

__all__ = [
    "HostPlacement",
    "Link",
    "SpreadPlacement",
    "Testbed",
    "TestbedBusyError",
    "TestbedUnavailableError",
    "check_available",
    "cleanup",
    "host_resource",
    "on_host",
]
