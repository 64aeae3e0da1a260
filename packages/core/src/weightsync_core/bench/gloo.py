"""Benchmark: the ``gloo`` engine against raw gloo broadcast and the Ray object store.

All three move the same bytes between Ray actor processes on this machine in one run, so
their ratio is meaningful even where absolute seconds are not.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
import torch
from torch.distributed.distributed_c10d import BroadcastOptions

from weightsync_core.api.hosts import default_host
from weightsync_core.api.session_key import new_session_key
from weightsync_core.bench.measure import (
    Measurement,
    bench_config,
    gbps,
    median_seconds,
    method_rows,
    pass_rows,
    passes_of,
    sync_seconds,
    synthetic_deployment,
)
from weightsync_core.net.process_group import (
    create_store,
    listen_on_free_port,
    new_gloo_group,
    rendezvous,
)

__all__ = ["BenchmarkResult", "RawBroadcastPeer", "raw_broadcast_group", "raw_broadcasts",
           "run_gloo_benchmark"]


class RawBroadcastPeer:
    """A Ray actor that broadcasts one flat buffer with plain gloo (the raw baseline) and
    fetches state dicts from the object store (the naive baseline)."""

    def prepare(self) -> dict[str, Any]:
        """Listen on a free port; returns this peer's address (rank 0's is the group's)."""
        host = default_host()
        self.listener = listen_on_free_port(host)
        return {"host": host, "port": self.listener.getsockname()[1]}

    def setup(self, rank: int, world_size: int, master: dict[str, Any], nbytes: int,
              key: bytes) -> None:
        """Join the raw group (its rendezvous store sealed with ``key``) and allocate (and
        touch) the buffer."""
        if rank != 0:
            self.listener.close()
        self.store = create_store(
            master["host"], master["port"], rank, world_size, 120, "raw", key, self.listener
        )
        rendezvous(self.store, rank, world_size, 120)
        self.group = new_gloo_group(self.store.store, rank, world_size, 120, default_host())
        fill = 1 if rank == 0 else 0
        self.buffer = torch.full((nbytes,), fill, dtype=torch.uint8)

    def broadcast(self) -> float:
        """Seconds for one broadcast of the whole buffer from rank 0, barrier to barrier."""
        options = BroadcastOptions()
        options.rootRank = 0
        # torch's stub of ProcessGroupGloo (a c10d Backend) omits its collectives
        self.group.barrier().wait()  # pyright: ignore[reportAttributeAccessIssue]
        start = time.perf_counter()
        self.group.broadcast(  # pyright: ignore[reportAttributeAccessIssue]
            [self.buffer], options
        ).wait()
        self.group.barrier().wait()  # pyright: ignore[reportAttributeAccessIssue]
        return time.perf_counter() - start

    def fetch(self, wrapped: list[ray.ObjectRef]) -> int:
        """Get a state dict from the object store; returns its size in bytes."""
        state_dict = ray.get(wrapped[0])
        return sum(t.numel() * t.element_size() for t in state_dict.values())


@contextmanager
def raw_broadcast_group(
    nbytes: int, peer_options: Sequence[dict[str, Any]]
) -> Iterator[list[Any]]:
    """:class:`RawBroadcastPeer` actors, one per entry of ``peer_options`` (extra
    ``ray.remote`` options; the first peer is the root), joined into one gloo group with a
    buffer of ``nbytes`` each; stopped on leaving."""
    peer = ray.remote(RawBroadcastPeer)
    # Ray types a handle's methods as plain functions (no ``.remote``): handles are Any here
    peers: list[Any] = [peer.options(num_cpus=0, **options).remote() for options in peer_options]
    try:
        addresses = ray.get([peer.prepare.remote() for peer in peers])
        key = new_session_key()
        ray.get([peer.setup.remote(rank, len(peers), addresses[0], nbytes, key)
                 for rank, peer in enumerate(peers)])
        yield peers
    finally:
        for handle in peers:
            ray.kill(handle)


def raw_broadcasts(peers: Sequence[Any]) -> Measurement:
    """The measurement of one broadcast through a :func:`raw_broadcast_group`: the slowest
    peer's seconds (figure ``"raw"``)."""
    return lambda _step: {"raw": max(ray.get([peer.broadcast.remote() for peer in peers]))}


@dataclass
class BenchmarkResult:
    """Median seconds of each way of moving ``nbytes`` to ``receivers`` processes."""

    nbytes: int
    receivers: int
    bucket_megabytes: int
    verify: bool
    engine_transfer_seconds: float
    engine_sync_seconds: float
    raw_broadcast_seconds: float
    object_store_seconds: float
    engine_passes: dict[str, float] = field(default_factory=dict)

    def gbps(self, seconds: float) -> float:
        """Payload GB/s (each receiver gets ``nbytes``)."""
        return gbps(self.nbytes, seconds)

    def as_dict(self) -> dict[str, Any]:
        """Result with derived rates and ratios."""
        data = asdict(self)
        data.update(
            engine_transfer_gbps=self.gbps(self.engine_transfer_seconds),
            engine_sync_gbps=self.gbps(self.engine_sync_seconds),
            raw_broadcast_gbps=self.gbps(self.raw_broadcast_seconds),
            object_store_gbps=self.gbps(self.object_store_seconds),
            engine_vs_raw=self.raw_broadcast_seconds / self.engine_transfer_seconds,
            engine_vs_object_store=self.object_store_seconds / self.engine_transfer_seconds,
        )
        return data

    def table(self) -> str:
        """Human-readable summary."""
        rows = [
            ("gloo engine (transfer stage)", self.engine_transfer_seconds),
            ("gloo engine (whole sync)", self.engine_sync_seconds),
            ("raw gloo broadcast", self.raw_broadcast_seconds),
            ("Ray object store", self.object_store_seconds),
        ]
        derived = self.as_dict()
        return "\n".join([
            f"{self.nbytes / 2**30:.2f} GiB from 1 actor rank to {self.receivers} rollout "
            f"workers, {self.bucket_megabytes} MiB buckets, verify={self.verify}",
            *method_rows(rows, self.nbytes, 32),
            f"engine / raw broadcast throughput: {derived['engine_vs_raw']:.2f}x; "
            f"engine / object store: {derived['engine_vs_object_store']:.1f}x",
            *pass_rows({"gloo engine": self.engine_passes}),
        ])


def _object_store_seconds(peers: list[Any], state_dict: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    ref = ray.put(state_dict)
    ray.get([peer.fetch.remote([ref]) for peer in peers])
    return time.perf_counter() - start


def run_gloo_benchmark(
    size_megabytes: int = 1024,
    receivers: int = 2,
    bucket_megabytes: int = 256,
    num_tensors: int = 64,
    repeats: int = 5,
    verify: bool = True,
) -> BenchmarkResult:
    """Measure the ``gloo`` engine, raw gloo broadcast and the Ray object store in one run.

    Engine syncs and raw broadcasts alternate, so drifting load on the machine affects both
    alike; each figure is the median of ``repeats``.
    """
    config = bench_config("gloo", {}, bucket_megabytes, verify)
    with (
        synthetic_deployment(config, 1, (receivers,), size_megabytes << 20,
                             num_tensors) as (deployment, nbytes),
        raw_broadcast_group(nbytes, [{}] * (receivers + 1)) as peers,
    ):
        engine = sync_seconds(deployment.manager(), passes="engine", transfer="transfer",
                              total="total")
        medians = median_seconds([engine, raw_broadcasts(peers)], repeats)
        numel = nbytes // num_tensors // 4
        state_dict = {f"layer.{i}.weight": torch.rand(numel) for i in range(num_tensors)}
        medians |= median_seconds(
            [lambda _step: {"object_store": _object_store_seconds(peers[1:], state_dict)}],
            repeats, warm_up=False,
        )
    return BenchmarkResult(
        nbytes, receivers, bucket_megabytes, verify, medians["transfer"], medians["total"],
        medians["raw"], medians["object_store"], passes_of(medians, "engine"),
    )
