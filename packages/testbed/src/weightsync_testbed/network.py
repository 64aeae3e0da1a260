"""Emulated hosts on one machine: a network namespace per host, joined to one bridge by a
veth pair, each link shaped in both directions.

Layout (prefix ``wst`` by default; every name the testbed creates starts with it)::

    root namespace: bridge <prefix>-br, 198.18.<n>.1/24 (the Ray head and the driver)
    host i:         namespace <prefix>-<name>, eth0 = 198.18.<n>.(10+i)/24, lo up
                    veth <prefix>-<name> (root side, on the bridge) <-> eth0 (host side)

Shaping: ``tbf`` on the egress of both ends of the veth (host -> bridge, bridge -> host), so
each host has a full-duplex NIC at ``rate``. Traffic between processes of one host stays
on its own loopback, unshaped. Addresses come from 198.18.0.0/15 only (RFC 2544, reserved
for benchmarks). Faults (:meth:`Network.link_down`, :meth:`Network.set_loss`,
:meth:`Network.partition`, :meth:`Network.set_delay`) change a running network.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BENCHMARK_NETWORK",
    "Link",
    "Network",
    "NicBytes",
    "TestbedUnavailableError",
    "check_available",
    "leftovers",
    "remove_leftovers",
]

BENCHMARK_NETWORK = ipaddress.ip_network("198.18.0.0/15")
"""RFC 2544's range for network benchmarks: the only addresses a testbed uses."""

_UNREACHABLE_MAC = "02:00:00:00:00:00"
"""A locally administered MAC no interface has: frames sent to it are silently dropped."""

NETNS_ETC = Path("/etc/netns")
"""``ip netns exec NAME`` mounts the files of ``/etc/netns/NAME/`` over ``/etc``: each host
gets its own ``hosts`` (every testbed host by name) and a ``resolv.conf`` without servers,
so that the reverse lookups c10d and others make of peer addresses answer at once instead
of waiting on a DNS server the hosts cannot reach."""


def subnet_of(prefix: str) -> int:
    """The default third octet of a testbed's addresses (1..250, from its prefix)."""
    return zlib.crc32(prefix.encode()) % 250 + 1


class TestbedUnavailableError(RuntimeError):
    """This machine cannot host a testbed (not root, no ``ip``/``tc``, no namespaces)."""

    __test__ = False  # not a pytest test class, whatever its name


@dataclass(frozen=True)
class Link:
    """One host's NIC: ``rate`` in both directions (``tc`` units, e.g. ``"1gbit"``), and the
    ``tbf`` burst and queue latency. ``rate=None`` leaves the link unshaped."""

    rate: str | None = "1gbit"
    burst: str = "256kb"
    queue_latency: str = "50ms"

    @property
    def bits_per_second(self) -> float | None:
        """``rate`` in bits per second (``None`` if unshaped)."""
        if self.rate is None:
            return None
        units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bit": 1.0}
        for suffix, scale in units.items():
            if self.rate.endswith(suffix):
                return float(self.rate[: -len(suffix)]) * scale
        raise ValueError(f"link rate {self.rate!r}: use tc units in bits, e.g. '1gbit'")


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({result.returncode}): "
                           f"{result.stderr.strip() or result.stdout.strip()}")
    return result


def check_available() -> None:
    """Raise :class:`TestbedUnavailableError` naming what is missing, else return."""
    import os

    if os.geteuid() != 0:
        raise TestbedUnavailableError("the testbed needs root (network namespaces, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedUnavailableError(f"the testbed needs `{tool}` (Debian: iproute2)")
    probe = "wst-probe"
    result = _run("ip", "netns", "add", probe, check=False)
    if result.returncode != 0:
        raise TestbedUnavailableError(f"cannot create network namespaces: {result.stderr.strip()}")
    _run("ip", "netns", "del", probe, check=False)


@dataclass(frozen=True)
class NicBytes:
    """Bytes a host's NIC has sent and received since it was created (Ethernet frames)."""

    sent: int
    received: int

    def __sub__(self, earlier: NicBytes) -> NicBytes:
        return NicBytes(self.sent - earlier.sent, self.received - earlier.received)

    def __add__(self, other: NicBytes) -> NicBytes:
        return NicBytes(self.sent + other.sent, self.received + other.received)


@dataclass
class _Host:
    name: str
    namespace: str
    veth: str
    address: str


class Network:
    """N emulated hosts on a bridge. Use :meth:`create` and :meth:`destroy` (the
    :class:`~weightsync_testbed.Testbed` does both).

    Args:
        hosts: host names (short, ``[a-z0-9]``), e.g. ``["a0", "r0", "r1"]``.
        link: every host's NIC.
        prefix: first part of every namespace and interface name.
        subnet: third octet of 198.18.<subnet>.0/24 (default: derived from ``prefix``, so
            that testbeds of different prefixes can run side by side).
    """

    def __init__(
        self, hosts: list[str], link: Link | None = None, prefix: str = "wst",
        subnet: int | None = None,
    ) -> None:
        if not hosts:
            raise ValueError("a testbed needs at least one host")
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"host names must differ: {hosts}")
        for name in hosts:
            if not name.isalnum() or not name.islower() or len(prefix) + len(name) > 13:
                raise ValueError(
                    f"host name {name!r}: use lower-case letters and digits, at most "
                    f"{13 - len(prefix)} characters (interface names are short)"
                )
        if subnet is None:
            subnet = subnet_of(prefix)
        if not 0 <= subnet <= 255 or len(hosts) > 200:
            raise ValueError("subnet is 0..255 and a testbed has at most 200 hosts")
        self.link = link or Link()
        self.prefix = prefix
        self.subnet = subnet
        self.bridge = f"{prefix}-br"
        self.gateway = str(ipaddress.ip_address(f"198.18.{subnet}.1"))
        self.hosts = {
            name: _Host(name, f"{prefix}-{name}", f"{prefix}-{name}", f"198.18.{subnet}.{10 + i}")
            for i, name in enumerate(hosts)
        }
        for host in self.hosts.values():
            assert ipaddress.ip_address(host.address) in BENCHMARK_NETWORK

    # -- life cycle ------------------------------------------------------------------------
    def create(self) -> None:
        """Create the bridge, the namespaces, the veth pairs and the shaping."""
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        # a fixed MAC: a bridge otherwise takes its lowest port's, which changes when that
        # port goes down, leaving every host's ARP entry of the gateway (the Ray head) stale
        _run("ip", "link", "set", self.bridge, "address", self._bridge_mac)
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for host in self.hosts.values():
            self._create_host(host)

    @property
    def _bridge_mac(self) -> str:
        octets = ipaddress.ip_address(self.gateway).packed
        return "02:77:73:" + ":".join(f"{octet:02x}" for octet in octets[1:])

    def _etc_files(self, host: _Host) -> None:
        folder = NETNS_ETC / host.namespace
        folder.mkdir(parents=True, exist_ok=True)
        names = [f"{self.gateway}\thead"] + [f"{h.address}\t{h.name}"
                                               for h in self.hosts.values()]
        (folder / "hosts").write_text(
            f"127.0.0.1\tlocalhost\n{host.address}\t{host.name}-self\n" + "\n".join(names)
            + "\n")
        (folder / "resolv.conf").write_text("# weightsync testbed host: no DNS server\n")

    def _create_host(self, host: _Host) -> None:
        peer = f"{host.veth}p"
        self._etc_files(host)
        _run("ip", "netns", "add", host.namespace)
        _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", host.namespace)
        _run("ip", "-n", host.namespace, "link", "set", peer, "name", "eth0")
        _run("ip", "link", "set", host.veth, "master", self.bridge)
        _run("ip", "link", "set", host.veth, "up")
        _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", host.namespace, "link", "set", "eth0", "up")
        _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
        _run("ip", "-n", host.namespace, "route", "add", "default", "via", self.gateway)
        self.shape(host.name, self.link)

    def destroy(self) -> None:
        """Remove every namespace and interface of this network (idempotent)."""
        for host in self.hosts.values():
            _run("ip", "netns", "del", host.namespace, check=False)
            _run("ip", "link", "del", host.veth, check=False)
            shutil.rmtree(NETNS_ETC / host.namespace, ignore_errors=True)
        _run("ip", "link", "del", self.bridge, check=False)

    # -- addressing --------------------------------------------------------------------------
    def address(self, host: str) -> str:
        """The address of ``host``'s NIC."""
        return self._host(host).address

    def host_of(self, address: str) -> str | None:
        """The host name owning ``address``, if any."""
        return next((h.name for h in self.hosts.values() if h.address == address), None)

    def namespace(self, host: str) -> str:
        """The network namespace of ``host``."""
        return self._host(host).namespace

    def exec_prefix(self, host: str) -> list[str]:
        """Prefix of a command line that runs inside ``host``."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def _host(self, name: str) -> _Host:
        try:
            return self.hosts[name]
        except KeyError:
            hosts = list(self.hosts)
            raise KeyError(f"no host {name!r} in this testbed (hosts: {hosts})") from None

    def nic_bytes(self, host: str) -> NicBytes:
        """What ``host``'s NIC has carried (its ``eth0`` counters)."""
        shown = _run("ip", "-n", self.namespace(host), "-j", "-s", "link", "show", "dev",
                     "eth0").stdout
        stats = json.loads(shown)[0]["stats64"]
        return NicBytes(int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))

    # -- shaping and faults --------------------------------------------------------------------
    def shape(self, host: str, link: Link) -> None:
        """Set ``host``'s NIC to ``link`` in both directions."""
        target = self._host(host)
        for device in ([target.veth], ["-n", target.namespace, "eth0"]):
            *netns, dev = device
            base = ["tc", *netns, "qdisc"]
            _run(*base, "del", "dev", dev, "root", check=False)
            if link.rate is not None:
                _run(*base, "add", "dev", dev, "root", "tbf", "rate", link.rate,
                     "burst", link.burst, "latency", link.queue_latency)

    def link_down(self, host: str) -> None:
        """Unplug ``host``'s cable: nothing in or out until :meth:`link_up`."""
        _run("ip", "link", "set", self._host(host).veth, "down")

    def link_up(self, host: str) -> None:
        """Plug ``host``'s cable back in."""
        _run("ip", "link", "set", self._host(host).veth, "up")

    def partition(self, first: str, second: str) -> None:
        """Cut ``first`` and ``second`` off from each other (both stay reachable from every
        other host): each sends the other's frames to a MAC no one has, so they vanish
        silently, as on a broken switch path."""
        a, b = self._host(first), self._host(second)
        for source, target in ((a, b), (b, a)):
            _run("ip", "-n", source.namespace, "neigh", "replace", target.address,
                 "lladdr", _UNREACHABLE_MAC, "dev", "eth0", "nud", "permanent")

    def heal(self, first: str, second: str) -> None:
        """Undo :meth:`partition`."""
        a, b = self._host(first), self._host(second)
        for source, target in ((a, b), (b, a)):
            _run("ip", "-n", source.namespace, "neigh", "del", target.address, "dev", "eth0",
                 check=False)

    def set_loss(self, host: str, percent: float) -> None:
        """Drop ``percent`` of the packets ``host`` sends and receives (random, with
        nftables; 0 removes the rule)."""
        if not 0 <= percent < 100:
            raise ValueError(f"loss is a percentage in [0, 100), not {percent}")
        target = self._host(host)
        if shutil.which("nft") is None:
            raise TestbedUnavailableError("packet loss needs `nft` (Debian: nftables)")
        netns = ["ip", "netns", "exec", target.namespace, "nft"]
        _run(*netns, "delete", "table", "inet", "wst_loss", check=False)
        if percent == 0:
            return
        per_mille = round(percent * 10)
        _run(*netns, "add", "table", "inet", "wst_loss")
        for chain, hook in (("out", "output"), ("in", "input")):
            _run(*netns, "add", "chain", "inet", "wst_loss", chain,
                 f"{{ type filter hook {hook} priority 0; }}")
            # loopback stays lossless: only the NIC is faulty
            _run(*netns, "add", "rule", "inet", "wst_loss", chain,
                 "meta", "iifname" if hook == "input" else "oifname", "eth0",
                 "numgen", "random", "mod", "1000", "<", str(per_mille), "drop")

    def set_delay(self, host: str, milliseconds: float) -> None:
        """Delay every packet ``host`` sends by ``milliseconds`` (``netem``; kernels without
        ``sch_netem`` raise :class:`TestbedUnavailableError`)."""
        target = self._host(host)
        result = _run("tc", "-n", target.namespace, "qdisc", "replace", "dev", "eth0", "root",
                      "netem", "delay", f"{milliseconds}ms", check=False)
        if result.returncode != 0:
            raise TestbedUnavailableError(
                f"delay needs the kernel's netem queueing discipline: {result.stderr.strip()}"
            )
        if milliseconds == 0:
            self.shape(host, self.link)


def _is_testbed_name(name: str, prefix: str | None) -> bool:
    if prefix is not None:
        return name.startswith(f"{prefix}-")
    head, dash, _ = name.partition("-")
    return bool(dash) and head.startswith("wst") and head.isalnum()


def leftovers(prefix: str | None = None) -> dict[str, list[str]]:
    """Namespaces, interfaces and ``/etc/netns`` folders of the testbed ``prefix`` (``None``:
    of any testbed, i.e. named ``wst*-...``) that exist now."""
    namespaces = [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines()
                  if _is_testbed_name(line.split()[0], prefix)]
    links = []
    for line in _run("ip", "-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if _is_testbed_name(name, prefix):
            links.append(name)
    folders = sorted(str(path) for path in NETNS_ETC.glob("*")
                     if _is_testbed_name(path.name, prefix)) if NETNS_ETC.exists() else []
    return {"namespaces": namespaces, "links": links, "etc": folders}


def remove_leftovers(prefix: str | None = None) -> dict[str, list[str]]:
    """Delete the namespaces and interfaces :func:`leftovers` finds; returns them."""
    found = leftovers(prefix)
    for namespace in found["namespaces"]:
        _run("ip", "netns", "del", namespace, check=False)
    for link in found["links"]:
        _run("ip", "link", "del", link, check=False)
    for folder in found["etc"]:
        shutil.rmtree(folder, ignore_errors=True)
    return found
