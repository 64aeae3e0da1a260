"""The gloo engine in one process (sender and receivers on threads), without Ray."""

import asyncio
import threading

import pytest
import torch
import torch.distributed as dist
from weightsync_core.engines import GlooCheckpointEngine
from weightsync_core.errors import SenderAbortedError, TransferError, VerificationError
from weightsync_core.testing import digests, make_weights

BUCKET = 256 << 10


def run_sync(engine_cls, weights, receivers=2, sender_bucket=BUCKET, receiver_bucket=BUCKET):
    """One sender and ``receivers`` receivers on threads; returns per-rank results/errors."""
    sender = engine_cls(sender_bucket, host="127.0.0.1", timeout=20)
    rollout = [engine_cls(receiver_bucket, host="127.0.0.1", timeout=20) for _ in range(receivers)]
    metadata = [sender.prepare()] + [engine.prepare() for engine in rollout]
    actor_kwargs, rollout_kwargs = engine_cls.build_topology(1, receivers, metadata)
    results: dict[int, object] = {}

    def run(rank, engine, kwargs):
        async def body():
            engine.init_process_group(**kwargs)
            try:
                if rank == 0:
                    return await engine.send_weights(weights)
                return {name: tensor async for name, tensor in engine.receive_weights()}
            finally:
                engine.finalize()

        try:
            results[rank] = asyncio.run(body())
        except Exception as exc:
            results[rank] = exc

    sender_kwargs = {key: values[0] for key, values in actor_kwargs.items()}
    threads = [threading.Thread(target=run, args=(0, sender, sender_kwargs))]
    for index, engine in enumerate(rollout):
        kwargs = {key: values[index] for key, values in rollout_kwargs.items()}
        threads.append(threading.Thread(target=run, args=(index + 1, engine, kwargs)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return results


def test_bit_exact_without_touching_the_default_process_group():
    weights = make_weights(seed=3, bucket_size=BUCKET)
    results = run_sync(GlooCheckpointEngine, weights)
    assert not dist.is_initialized()
    stats = results[0]
    assert stats.num_tensors == len(weights)
    assert stats.num_buckets >= 6
    for rank in (1, 2):
        assert digests(results[rank]) == digests(weights)


def test_sender_failure_reaches_receivers_as_an_abort_not_a_hang():
    def weights():
        yield "a", torch.ones(BUCKET // 2)
        yield "b", torch.ones(BUCKET // 2)
        raise RuntimeError("generator exploded")

    results = run_sync(GlooCheckpointEngine, weights())
    assert isinstance(results[0], RuntimeError)
    for rank in (1, 2):
        assert isinstance(results[rank], SenderAbortedError)
        assert "generator exploded" in str(results[rank])
        assert "actor rank 0" in str(results[rank])


def test_corruption_on_the_wire_is_caught_and_names_the_tensors():
    class Corrupting(GlooCheckpointEngine):
        async def _receive_message(self, buffer):
            kind, payload, data = await super()._receive_message(buffer)
            if data.numel():
                data[-1] ^= 0x01
            return kind, payload, data

    results = run_sync(Corrupting, {"layer.0.weight": torch.randn(1000)}, receivers=1)
    assert isinstance(results[1], VerificationError)
    assert "layer.0.weight" in str(results[1])


def test_mismatched_bucket_sizes_are_reported():
    results = run_sync(
        GlooCheckpointEngine, {"w": torch.randn(BUCKET // 2)}, receivers=1,
        receiver_bucket=BUCKET // 4,
    )
    assert isinstance(results[1], TransferError)
    assert "update_weights_bucket_megabytes" in str(results[1])


def test_build_topology_matches_verl():
    metadata = [{"host": "h", "port": 1}] * 5
    actor, rollout = GlooCheckpointEngine.build_topology(2, 3, metadata)
    assert actor == {"rank": [0, -1], "world_size": [4, 4], "master_metadata": [metadata[0]] * 2}
    assert rollout["rank"] == [1, 2, 3]
    with pytest.raises(ValueError, match="at least one actor rank and one rollout worker"):
        GlooCheckpointEngine.build_topology(1, 0, metadata)


def test_consumer_that_keeps_every_tensor_never_sees_them_overwritten():
    """Zero-copy receive: buffers still viewed by the consumer are not reused."""
    weights = {f"w{i}": torch.full((BUCKET // 4 // 2,), float(i)) for i in range(12)}
    results = run_sync(GlooCheckpointEngine, weights, receivers=1)
    kept = results[1]  # the receiver kept all 12 tensors (6+ buckets) alive
    for i in range(12):
        assert torch.all(kept[f"w{i}"] == i), f"w{i} was overwritten"


def test_streaming_consumer_reuses_three_receive_buffers():
    from weightsync_core.bucketing import ReceiveBuffers

    buffers = ReceiveBuffers(lambda: torch.zeros(16, dtype=torch.uint8))
    held = None
    for index in range(10):
        held = buffers.take(index)[:4]  # the consumer holds a view of the latest bucket
    assert buffers.allocations == 3
    kept = buffers.take(10)[:2]  # slot 1 stays viewed, so bucket 13 must not reuse it
    assert buffers.take(13).data_ptr() != kept.data_ptr()
    assert buffers.allocations == 4
    del held
