"""Benchmark: a ring engine (``nixl``, ``mooncake``) to 1 and to N rollout workers, against
one raw transfer of the same bytes through the engine's own transport.

Engine syncs to 1 worker, to N workers and raw transfers alternate in one run, so drifting
load on the machine affects all alike; each figure is the median of ``repeats``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
import torch

from weightsync_core.api.config import CheckpointEngineConfig
from weightsync_core.bench.measure import (
    Measurement,
    bench_config,
    median_seconds,
    method_rows,
    pass_rows,
    passes_of,
    sync_seconds,
    synthetic_deployment,
)
from weightsync_core.engines.ring import RingCheckpointEngine
from weightsync_core.net.transport import RemoteBuffer
from weightsync_core.worker import build_engine

__all__ = ["RawTransferPeer", "RingBenchmarkResult", "raw_writes", "run_ring_benchmark"]


class RawTransferPeer:
    """A Ray actor holding one registered buffer of the whole payload in the engine's own
    transport, configured exactly as the engine's (the raw baseline)."""

    def __init__(self, config: CheckpointEngineConfig, nbytes: int, fill: int) -> None:
        engine = build_engine(config)
        if not isinstance(engine, RingCheckpointEngine):
            raise TypeError(f"backend {config.backend!r} is not a ring engine")
        self.transport = engine.transport
        self.buffer = torch.full((nbytes,), fill, dtype=torch.uint8)
        self.descriptor = self.transport.register(self.buffer)

    def address(self) -> tuple[Any, RemoteBuffer]:
        """What a writer needs: transport metadata and the registered buffer."""
        return self.transport.metadata(), self.descriptor

    def write_to(self, target: tuple[Any, RemoteBuffer]) -> float:
        """Seconds for one write of the whole buffer into ``target``."""
        peer = self.transport.connect(target[0])
        start = time.perf_counter()
        self.transport.write(peer, self.buffer, target[1], 600)
        return time.perf_counter() - start

    def checksum(self) -> int:
        """Sum of the buffer's bytes (to check the raw write really landed)."""
        return int(self.buffer.sum(dtype=torch.int64))


@dataclass
class RingBenchmarkResult:
    """Median seconds of the engine to 1 and to ``receivers`` workers, and of a raw write."""

    backend: str
    nbytes: int
    receivers: int
    bucket_megabytes: int
    verify: bool
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    one_receiver_seconds: float = 0.0
    many_receivers_seconds: float = 0.0
    raw_seconds: float = 0.0
    one_receiver_passes: dict[str, float] = field(default_factory=dict)
    many_receivers_passes: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Result with derived ratios: ``engine_vs_raw`` (throughput, 1 receiver; target
        >= 0.8) and ``many_vs_one`` (time; target <= 1.3)."""
        data = asdict(self)
        data.update(
            engine_vs_raw=self.raw_seconds / self.one_receiver_seconds,
            many_vs_one=self.many_receivers_seconds / self.one_receiver_seconds,
        )
        return data

    def table(self) -> str:
        """Human-readable summary."""
        rows = [
            (f"{self.backend} engine, 1 rollout worker", self.one_receiver_seconds),
            (f"{self.backend} engine, {self.receivers} rollout workers",
             self.many_receivers_seconds),
            (f"raw {self.backend} transport write", self.raw_seconds),
        ]
        derived = self.as_dict()
        return "\n".join([
            f"{self.nbytes / 2**30:.2f} GiB from 1 actor rank, {self.bucket_megabytes} MiB "
            f"buckets, verify={self.verify}, engine_kwargs={self.engine_kwargs}",
            *method_rows(rows, self.nbytes, 40),
            f"engine (1 worker) / raw throughput: {derived['engine_vs_raw']:.2f}x (target >= 0.8)",
            f"{self.receivers} workers / 1 worker time: {derived['many_vs_one']:.2f}x "
            "(target <= 1.3)",
            *pass_rows({"1 worker": self.one_receiver_passes,
                        f"{self.receivers} workers": self.many_receivers_passes}),
        ])


@contextmanager
def raw_writes(
    config: CheckpointEngineConfig, nbytes: int,
    writer_options: dict[str, Any] | None = None, reader_options: dict[str, Any] | None = None,
) -> Iterator[Measurement]:
    """Two :class:`RawTransferPeer` processes (started with the given ``ray.remote``
    options); yields the measurement of one write of ``nbytes`` from one into the other
    (figure ``"raw"``), checks on leaving that the writes landed, then stops both."""
    peer = ray.remote(RawTransferPeer)
    # Ray types a handle's methods as plain functions (no ``.remote``): handles are Any here
    writer: Any = peer.options(num_cpus=0, **(writer_options or {})).remote(config, nbytes, 1)
    reader: Any = peer.options(num_cpus=0, **(reader_options or {})).remote(config, nbytes, 0)
    try:
        target = ray.get(reader.address.remote())
        yield lambda _step: {"raw": ray.get(writer.write_to.remote(target))}
        if ray.get(reader.checksum.remote()) != nbytes:
            raise RuntimeError(f"the raw {config.backend} write did not deliver the buffer")
    finally:
        for handle in (writer, reader):
            ray.kill(handle)


def run_ring_benchmark(
    backend: str,
    engine_kwargs: dict[str, Any] | None = None,
    size_megabytes: int = 1024,
    receivers: int = 3,
    bucket_megabytes: int = 64,
    num_tensors: int = 64,
    repeats: int = 5,
    verify: bool = True,
) -> RingBenchmarkResult:
    """Measure ``backend`` (transfer stage of a sync) to 1 and to ``receivers`` rollout
    workers, and a raw write of the same bytes between two processes, in one run."""
    kwargs = dict(engine_kwargs or {})
    config = bench_config(backend, kwargs, bucket_megabytes, verify)
    with (
        synthetic_deployment(config, 1, (1,) * receivers, size_megabytes << 20,
                             num_tensors) as (deployment, nbytes),
        raw_writes(config, nbytes) as raw,
    ):
        one = sync_seconds(deployment.manager(deployment.replicas[:1]), passes="one",
                           one="transfer")
        many = sync_seconds(deployment.manager(), passes="many", many="transfer")
        medians = median_seconds([one, many, raw], repeats)
    return RingBenchmarkResult(
        backend, nbytes, receivers, bucket_megabytes, verify, kwargs,
        medians["one"], medians["many"], medians["raw"],
        passes_of(medians, "one"), passes_of(medians, "many"),
    )
