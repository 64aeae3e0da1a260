"""The emulated network on its own (no Ray): addresses, shaping, fault verbs, teardown."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from weightsync_testbed import Link
from weightsync_testbed.network import BENCHMARK_NETWORK, Network, leftovers

PREFIX = "wstn"

# a tiny TCP client/server, run inside the hosts' namespaces
_SERVER = """
import socket, sys, time
s = socket.create_server((sys.argv[1], 5201)); print("ready", flush=True)
c, _ = s.accept(); n = 0; start = time.perf_counter()
while (b := c.recv(1 << 20)): n += len(b)
print(n, time.perf_counter() - start, flush=True)
"""
_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 5201), timeout=float(sys.argv[3]))
c.sendall(b"x" * int(sys.argv[2])); c.close()
"""


@pytest.fixture(scope="module")
def network(namespaces_available):
    net = Network(["h0", "h1", "h2"], Link("200mbit"), prefix=PREFIX)
    net.create()
    yield net
    net.destroy()
    assert leftovers(PREFIX) == {"namespaces": [], "links": [], "etc": []}


def _transfer(network: Network, source: str, target: str, nbytes: int, timeout: float = 5):
    """Send ``nbytes`` from ``source`` to ``target`` over TCP: ``(seconds, received)`` as
    the receiver saw them, or ``None`` when the connection could not be made or timed
    out."""
    server = subprocess.Popen(
        [*network.exec_prefix(target), sys.executable, "-c", _SERVER, network.address(target)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert server.stdout.readline().strip() == "ready"
        client = subprocess.run(
            [*network.exec_prefix(source), sys.executable, "-c", _CLIENT,
             network.address(target), str(nbytes), str(timeout)],
            capture_output=True, text=True, timeout=timeout + 30, check=False,
        )
        if client.returncode != 0:
            return None
        received, seconds = server.communicate(timeout=30)[0].split()
        return float(seconds), int(received)
    finally:
        server.kill()
        server.wait()


def test_addresses_come_from_the_benchmark_range_only(network) -> None:
    import ipaddress

    for host in network.hosts:
        assert ipaddress.ip_address(network.address(host)) in BENCHMARK_NETWORK
    assert ipaddress.ip_address(network.gateway) in BENCHMARK_NETWORK


def test_links_are_shaped_to_their_rate(network) -> None:
    nbytes = 20 << 20
    seconds, received = _transfer(network, "h0", "h1", nbytes)
    assert received == nbytes
    rate = nbytes * 8 / seconds
    # the shaper caps the rate (a little burst allowance aside) and the link carries data
    assert 0.5 * 200e6 < rate < 1.1 * 200e6, f"{rate / 1e6:.0f} Mbit/s on a 200 Mbit/s link"


def test_hosts_resolve_each_other_by_name_without_dns(network) -> None:
    started = time.monotonic()
    lookup = subprocess.run(
        [*network.exec_prefix("h0"), sys.executable, "-c",
         f"import socket; print(socket.gethostbyaddr('{network.address('h1')}')[0])"],
        capture_output=True, text=True, check=True,
    )
    assert lookup.stdout.strip() == "h1"
    assert time.monotonic() - started < 5, "a reverse lookup waited on a DNS server"


def test_partition_cuts_two_hosts_off_each_other_only(network) -> None:
    network.partition("h0", "h1")
    try:
        assert _transfer(network, "h0", "h1", 1 << 20, timeout=2) is None
        assert _transfer(network, "h2", "h1", 1 << 20) is not None
        assert _transfer(network, "h0", "h2", 1 << 20) is not None
    finally:
        network.heal("h0", "h1")
    assert _transfer(network, "h0", "h1", 1 << 20) is not None


def test_link_down_cuts_a_host_off_until_it_comes_back(network) -> None:
    network.link_down("h2")
    try:
        assert _transfer(network, "h0", "h2", 1 << 20, timeout=2) is None
    finally:
        network.link_up("h2")
    assert _transfer(network, "h0", "h2", 1 << 20) is not None


def test_loss_drops_packets_but_tcp_still_delivers(network) -> None:
    network.set_loss("h1", 5)
    try:
        rules = subprocess.run(
            [*network.exec_prefix("h1"), "nft", "list", "table", "inet", "wst_loss"],
            capture_output=True, text=True, check=True,
        ).stdout
        assert rules.count("numgen random mod 1000 < 50 drop") == 2  # in and out
        assert _transfer(network, "h0", "h1", 2 << 20, timeout=30)[1] == 2 << 20
    finally:
        network.set_loss("h1", 0)
    assert subprocess.run(
        [*network.exec_prefix("h1"), "nft", "list", "tables"], capture_output=True, text=True,
        check=True,
    ).stdout.strip() == ""


def test_bad_host_names_and_rates_are_refused_before_anything_is_made() -> None:
    with pytest.raises(ValueError, match="lower-case letters and digits"):
        Network(["Host_0"])
    with pytest.raises(ValueError, match="must differ"):
        Network(["h0", "h0"])
    with pytest.raises(ValueError, match="tc units"):
        _ = Link("fast").bits_per_second
    assert Link("1gbit").bits_per_second == 1e9
