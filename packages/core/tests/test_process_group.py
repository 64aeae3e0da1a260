"""Dedicated stores and group set-up: fail fast and name the ranks that never arrived."""

import threading
import time

import pytest

from weightsync_core.errors import GroupInitTimeoutError
from weightsync_core.process_group import create_store, find_free_port, rendezvous


def test_rendezvous_names_the_missing_ranks():
    port = find_free_port()
    errors = {}

    def join(rank):
        try:
            store = create_store("127.0.0.1", port, rank, 4, 2.0, "test")
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


def test_unreachable_master_is_reported_as_rank_zero_missing():
    with pytest.raises(GroupInitTimeoutError, match="rank 0 never arrived") as info:
        create_store("127.0.0.1", find_free_port(), 1, 2, 1.0, "test")
    assert info.value.missing_ranks == [0]
