"""One emulated cluster for the whole test session: the standard placement's hosts on
1 Gbit/s links. Torn down at the end; the session fails if anything is left behind."""

from __future__ import annotations

import pytest

from weightsync_testbed import Link, Testbed, TestbedUnavailableError, check_available
from weightsync_testbed.cluster import kill_ray_processes
from weightsync_testbed.conformance import STANDARD_PLACEMENT
from weightsync_testbed.network import leftovers

PREFIX = "wstt"  # not the default, so that a developer's own testbed is left alone


@pytest.fixture(scope="session")
def namespaces_available() -> None:
    """Skip the tests that use this where network namespaces cannot be made, saying why."""
    try:
        check_available()
    except TestbedUnavailableError as exc:
        pytest.skip(f"no testbed on this machine: {exc}")


@pytest.fixture(scope="session")
def testbed(namespaces_available):
    """The session's testbed."""
    hosts = [*STANDARD_PLACEMENT.actors, *STANDARD_PLACEMENT.replicas]
    with Testbed(hosts=hosts, link=Link("1gbit"), prefix=PREFIX) as bed:
        yield bed
    left = leftovers(PREFIX)
    processes = kill_ray_processes(PREFIX)
    assert left == {"namespaces": [], "links": [], "etc": []}, f"left behind: {left}"
    assert processes == [], f"Ray processes left behind: {processes}"
