"""``weightsync plan --measure``'s probe: real sockets between real Ray actors."""

from __future__ import annotations

import secrets
import socket

import ray

from weightsync_core.plan.probe import ProbeReceiver, ProbeSender, measure_link


def test_probe_measures_a_link_between_two_actors():
    link = measure_link({}, {}, nbytes=8 << 20, pings=5)
    assert link.bandwidth > 1e6  # loopback: far above a megabyte a second
    assert 0 <= link.latency < 0.1


def test_probe_listens_on_the_configured_host_and_drops_strangers_unread():
    receiver = ray.remote(ProbeReceiver).options(num_cpus=0).remote()
    sender = ray.remote(ProbeSender).options(num_cpus=0).remote()
    try:
        host, port = ray.get(receiver.address.remote())
        assert host not in ("0.0.0.0", "::", "")
        token = secrets.token_bytes(32)
        served = receiver.serve.remote(token, 2, 1 << 20)
        with socket.create_connection((host, port), timeout=30) as stranger:
            stranger.sendall(b"x" * 32 + b"more bytes that must never be read")
            try:
                answer = stranger.recv(1)
            except ConnectionResetError:  # closed with the stranger's bytes unread
                answer = b""
            assert answer == b""
        latency, bulk = ray.get(sender.run.remote((host, port), token, 2, 1 << 20))
        ray.get(served, timeout=60)
        assert latency >= 0 and bulk > 0
    finally:
        for handle in (sender, receiver):
            ray.kill(handle)
