"""A sender's view of a rollout worker's landing buffer over real NIXL agents: when the worker
registers a larger landing where an old one began, the sender must load it afresh (NIXL
keeps a stale view of an address registered again, and a write past the old end fails)."""

from __future__ import annotations

import torch

from weightsync_core.data.shards import KnownReceivers, Landing
from weightsync_nixl import NixlTransport


def test_a_landing_registered_again_larger_at_the_same_address_is_written_to_its_end():
    receiver = NixlTransport(env={"UCX_TLS": "tcp"}, host="127.0.0.1")
    sender = NixlTransport(env={"UCX_TLS": "tcp"}, host="127.0.0.1")
    try:
        staging = torch.arange(100, dtype=torch.uint8)
        sender.register(staging)
        known = KnownReceivers(lambda: sender)
        memory = torch.zeros(50_000, dtype=torch.uint8)
        # landings that begin where earlier ones began (as a freed buffer's address is reused)
        for start, size in ((0, 5_000), (100, 9_000), (0, 300), (0, 50_000), (0, 50_000)):
            landing = memory[start:start + size]
            remote = receiver.register(landing)
            peer = known.connect(0, Landing(receiver.metadata(), remote))
            sender.write(peer, staging, remote.at(size - 100, 100), 10.0)
            assert torch.equal(landing[size - 100:], staging), size
            landing.zero_()
            receiver.deregister(landing)
    finally:
        sender.close()
        receiver.close()
