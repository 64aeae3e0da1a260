"""GlobalRequestLoadBalancer: least-in-flight routing with sticky sessions."""

import pytest

from weightsync_trainer import GlobalRequestLoadBalancer


def test_least_in_flight_then_fewest_served():
    balancer = GlobalRequestLoadBalancer(["a", "b", "c"])
    assert [balancer.acquire() for _ in range(3)] == ["a", "b", "c"]
    balancer.release("b")
    assert balancer.acquire() == "b"  # the only idle server
    for server in ("a", "b", "c"):
        balancer.release(server)
    # all idle: b has served most, a and c tie; a is listed first
    assert balancer.acquire() == "a"
    assert balancer.in_flight() == {"a": 1, "b": 0, "c": 0}


def test_sticky_sessions_by_request_id():
    balancer = GlobalRequestLoadBalancer(["a", "b"])
    assert balancer.acquire("conv-1") == "a"
    assert balancer.acquire("conv-2") == "b"
    balancer.release("a")
    balancer.release("b")
    balancer.acquire()  # a busy now
    assert balancer.acquire("conv-1") == "a"  # sticky even though b is idle


def test_sessions_are_bounded():
    balancer = GlobalRequestLoadBalancer(["a", "b"], max_sessions=1)
    assert balancer.acquire("r1") == "a"
    assert balancer.acquire("r2") == "b"  # only one session is kept: r1 is forgotten
    balancer.release("b")
    assert balancer.acquire("r1") == "b"  # routed afresh to the idle server, not back to a


def test_misuse_is_explained():
    with pytest.raises(ValueError, match="at least one server"):
        GlobalRequestLoadBalancer([])
    with pytest.raises(ValueError, match="unique"):
        GlobalRequestLoadBalancer(["a", "a"])
    with pytest.raises(ValueError, match="without a matching acquire"):
        GlobalRequestLoadBalancer(["a"]).release("a")
