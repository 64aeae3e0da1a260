"""Benchmark: the ``gloo`` engine against raw gloo broadcast and the Ray object store.

All three move the same bytes between Ray actor processes on this machine in one run, so
their ratio is meaningful even where absolute seconds are not.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import ray
import torch
from torch.distributed.distributed_c10d import BroadcastOptions

from weightsync_core.config import CheckpointEngineConfig
from weightsync_core.process_group import (
    create_store,
    default_host,
    listen_on_free_port,
    new_gloo_group,
    rendezvous,
)
from weightsync_core.testing.harness import SyncHarness, ensure_ray

__all__ = ["BenchmarkResult", "RawBroadcastPeer", "run_gloo_benchmark"]


class RawBroadcastPeer:
    """A Ray actor that broadcasts one flat buffer with plain gloo (the raw baseline) and
    fetches state dicts from the object store (the naive baseline)."""

    def prepare(self) -> dict[str, Any]:
        host = default_host()
        self.listener = listen_on_free_port(host)
        return {"host": host, "port": self.listener.getsockname()[1]}

    def setup(self, rank: int, world_size: int, master: dict[str, Any], nbytes: int) -> None:
        """Join the raw group and allocate (and touch) the buffer."""
        if rank != 0:
            self.listener.close()
        store = create_store(
            master["host"], master["port"], rank, world_size, 120, "raw", self.listener
        )
        rendezvous(store, rank, world_size, 120)
        self.group = new_gloo_group(store, rank, world_size, 120, default_host())
        fill = 1 if rank == 0 else 0
        self.buffer = torch.full((nbytes,), fill, dtype=torch.uint8)

    def broadcast(self) -> float:
        """Seconds for one broadcast of the whole buffer from rank 0, barrier to barrier."""
        options = BroadcastOptions()
        options.rootRank = 0
        self.group.barrier().wait()
        start = time.perf_counter()
        self.group.broadcast([self.buffer], options).wait()
        self.group.barrier().wait()
        return time.perf_counter() - start

    def fetch(self, wrapped: list[ray.ObjectRef]) -> int:
        """Get a state dict from the object store; returns its size in bytes."""
        state_dict = ray.get(wrapped[0])
        return sum(t.numel() * t.element_size() for t in state_dict.values())


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

    def gbps(self, seconds: float) -> float:
        """Payload GB/s (each receiver gets ``nbytes``)."""
        return self.nbytes / seconds / 1e9

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
        lines = [
            f"{self.nbytes / 2**30:.2f} GiB from 1 actor rank to {self.receivers} rollout "
            f"workers, {self.bucket_megabytes} MiB buckets, verify={self.verify}",
            f"{'method':32} {'seconds':>9} {'GB/s':>8}",
        ]
        lines += [f"{name:32} {seconds:9.3f} {self.gbps(seconds):8.2f}" for name, seconds in rows]
        derived = self.as_dict()
        lines.append(
            f"engine / raw broadcast throughput: {derived['engine_vs_raw']:.2f}x; "
            f"engine / object store: {derived['engine_vs_object_store']:.1f}x"
        )
        return "\n".join(lines)


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
    ensure_ray()
    config = CheckpointEngineConfig(
        backend="gloo", update_weights_bucket_megabytes=bucket_megabytes, verify=verify,
        sync_timeout_seconds=600,
    )
    harness = SyncHarness(config, actor_world_size=1, replica_sizes=(receivers,))
    peer_cls = ray.remote(num_cpus=0)(RawBroadcastPeer)
    peers = [peer_cls.remote() for _ in range(receivers + 1)]
    try:
        nbytes = ray.get(harness.actors[0].set_uniform_weights.remote(
            size_megabytes << 20, num_tensors
        ))
        workers = harness.replicas[0].workers
        ray.get([worker.set_faults.remote(discard=True) for worker in workers])
        master = ray.get(peers[0].prepare.remote())
        ray.get([peer.setup.remote(rank, len(peers), master, nbytes)
                 for rank, peer in enumerate(peers)])
        manager = harness.manager()
        manager.update_weights_sync(global_steps=0)  # warm-up: groups, buffers, page faults
        ray.get([peer.broadcast.remote() for peer in peers])
        transfer, total, raw = [], [], []
        for step in range(1, repeats + 1):
            metrics = manager.update_weights_sync(global_steps=step)
            transfer.append(metrics["weightsync/seconds/transfer"])
            total.append(metrics["weightsync/seconds/total"])
            raw.append(max(ray.get([peer.broadcast.remote() for peer in peers])))
        numel = nbytes // num_tensors // 4
        state_dict = {f"layer.{i}.weight": torch.rand(numel) for i in range(num_tensors)}
        object_store = statistics.median(
            _object_store_seconds(peers[1:], state_dict) for _ in range(repeats)
        )
    finally:
        harness.shutdown()
        for peer in peers:
            ray.kill(peer)
    return BenchmarkResult(
        nbytes, receivers, bucket_megabytes, verify, statistics.median(transfer),
        statistics.median(total), statistics.median(raw), object_store,
    )
