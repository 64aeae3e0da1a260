"""Dedicated stores and group set-up: fail fast and name the ranks that never arrived."""

import threading
import time

import pytest

from weightsync_core.api.errors import GroupInitTimeoutError
from weightsync_core.api.hosts import check_bind_host
from weightsync_core.api.session_key import new_session_key
from weightsync_core.net.process_group import (
    create_store,
    listen_on_free_port,
    rendezvous,
    reserve_port,
)

NOT_HERE = "192.0.2.1"
"""An address no machine holds (TEST-NET-1, reserved for documentation by RFC 5737)."""


KEY = new_session_key()


def test_rendezvous_names_the_missing_ranks():
    listener = listen_on_free_port("127.0.0.1")
    port = listener.getsockname()[1]
    errors = {}
    stores = []

    def join(rank):
        store = create_store("127.0.0.1", port, rank, 4, 2.0, "test", KEY, listener)
        stores.append(store)
        try:
            rendezvous(store, rank, 4, 2.0)
        except GroupInitTimeoutError as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 2)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
        time.sleep(0.2)
    for thread in threads:
        thread.join(20)
    assert time.monotonic() - start < 10
    assert set(errors) == {0, 2}
    assert errors[0].missing_ranks == [1, 3]
    assert "rank(s) [1, 3] never arrived" in str(errors[0])
    for store in stores:
        store.close()


def test_unreachable_master_is_reported_as_rank_zero_missing():
    with reserve_port("127.0.0.1") as unused, pytest.raises(
        GroupInitTimeoutError, match="rank 0 never arrived"
    ) as info:
        store = create_store("127.0.0.1", unused.getsockname()[1], 1, 2, 1.0, "test", KEY)
        rendezvous(store, 1, 2, 1.0)
    assert info.value.missing_ranks == [0]


def test_store_listens_on_the_configured_host_only_and_closes():
    listener = listen_on_free_port("127.0.0.1")
    port = listener.getsockname()[1]
    store = create_store("127.0.0.1", port, 0, 1, 2.0, "test", KEY, listener)
    store.store.set("key", "value")
    assert store.store.get("key") == b"value"
    listening = _listening_addresses(port)
    assert listening == {"127.0.0.1"}, listening
    store.close()
    assert not _listening_addresses(port)


def test_wildcard_hosts_are_refused():
    with pytest.raises(ValueError, match=r"not '0\.0\.0\.0'"):
        listen_on_free_port("0.0.0.0")


def test_an_address_of_no_interface_of_this_machine_is_refused_before_any_listener():
    assert check_bind_host("127.0.0.1") == "127.0.0.1"
    for refused in (lambda: check_bind_host(NOT_HERE), lambda: listen_on_free_port(NOT_HERE)):
        with pytest.raises(ValueError) as info:
            refused()
        message = str(info.value)
        assert f"is '{NOT_HERE}', which this machine" in message  # what was given
        assert "EADDRNOTAVAIL" in message  # why
        assert "an address of one of this machine's network interfaces" in message  # accepted
        assert "engine_kwargs[<backend>]['host']" in message and "WEIGHTSYNC_HOST" in message


def test_the_setting_that_gave_the_host_is_named():
    with pytest.raises(ValueError, match=r"^WEIGHTSYNC_HOST is '192\.0\.2\.1'"):
        check_bind_host(NOT_HERE, setting="WEIGHTSYNC_HOST")


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of this process's sockets listening on ``port`` (from /proc)."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as rows:
            for row in list(rows)[1:]:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(_address(address, width))
    return found


def _address(hex_address: str, width: int) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_address)
    if width == 8:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))
