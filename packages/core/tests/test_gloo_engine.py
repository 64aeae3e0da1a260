"""The gloo engine in one process (sender and receivers on threads), without Ray."""

import asyncio
import dataclasses
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from weightsync_core import ActorCheckpointEngineMixin, CheckpointEngineConfig
from weightsync_core.api.errors import SenderAbortedError, TransferError, VerificationError
from weightsync_core.api.session_key import new_session_key
from weightsync_core.engines import GlooCheckpointEngine
from weightsync_core.net.wire import MessageSealer
from weightsync_core.testing import digests, make_weights

BUCKET = 256 << 10


class ThreadedSync:
    """Actor and rollout engines in this process; each rank runs on its own thread per sync."""

    def __init__(self, engine_cls, actors=1, receivers=2, bucket=BUCKET, receiver_bucket=None,
                 **kwargs):
        self.engine_cls = engine_cls
        options = {"host": "127.0.0.1", "timeout": 20} | kwargs
        self.actors = [engine_cls(bucket, **options) for _ in range(actors)]
        self.rollout = [engine_cls(receiver_bucket or bucket, **options)
                        for _ in range(receivers)]

    def sync(self, weights):
        """Run one sync; ``weights`` is a state dict or a zero-argument factory of a stream.
        Returns (actor results, rollout results, actor kwargs): stats/dicts or exceptions."""
        engines = self.actors + self.rollout
        key = new_session_key()
        for engine in engines:
            engine.set_session_key(key)
        metadata = [engine.prepare() for engine in engines]
        actor_kwargs, rollout_kwargs = self.engine_cls.build_topology(
            len(self.actors), len(self.rollout), metadata
        )
        per_rank = [{key: values[i] for key, values in actor_kwargs.items()}
                    for i in range(len(self.actors))]
        per_rank += [{key: values[i] for key, values in rollout_kwargs.items()}
                     for i in range(len(self.rollout))]
        results: list[object] = [None] * len(engines)

        def run(index):
            engine, sending = engines[index], index < len(self.actors)

            async def body():
                engine.init_process_group(**per_rank[index])
                try:
                    if sending:
                        stream = weights() if callable(weights) else weights
                        return await engine.send_weights(stream)
                    return {name: tensor async for name, tensor in engine.receive_weights()}
                finally:
                    engine.finalize()

            try:
                results[index] = asyncio.run(body())
            except Exception as exc:
                results[index] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(engines))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a rank hung"
        return results[: len(self.actors)], results[len(self.actors):], actor_kwargs


def run_sync(engine_cls, weights, receivers=2, receiver_bucket=None, timeout=20):
    """One sync from one sender; results indexed by group rank (0 = sender)."""
    sent, received, _ = ThreadedSync(
        engine_cls, receivers=receivers, receiver_bucket=receiver_bucket, timeout=timeout
    ).sync(weights)
    return dict(enumerate(sent + received))


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

    results = run_sync(GlooCheckpointEngine, weights)
    assert isinstance(results[0], RuntimeError)
    for rank in (1, 2):
        assert isinstance(results[rank], SenderAbortedError)
        assert "generator exploded" in str(results[rank])
        assert "actor rank 0" in str(results[rank])


def test_corruption_on_the_wire_is_caught_and_names_the_tensors():
    class Corrupting(GlooCheckpointEngine):
        async def _receive_message(self, group, buffer):
            message, data = await super()._receive_message(group, buffer)
            if data.numel():
                data[-1] ^= 0x01
            return message, data

    results = run_sync(Corrupting, {"layer.0.weight": torch.randn(1000)}, receivers=1, timeout=3)
    assert isinstance(results[1], VerificationError)
    assert "layer.0.weight" in str(results[1])


def test_metadata_sealed_under_another_key_is_refused_naming_the_sender():
    class Forging(GlooCheckpointEngine):
        """Seals its messages under a key of its own, as an outsider on the wire would."""

        def _post_message(self, group, message, data=None):
            forged = dataclasses.replace(group, sealer=MessageSealer(new_session_key()))
            return super()._post_message(forged, message, data)

    results = run_sync(Forging, {"w": torch.randn(100)}, receivers=1, timeout=3)
    assert isinstance(results[1], TransferError)
    assert "refused a message from actor rank 0" in str(results[1])
    assert "authentication tag" in str(results[1])


def test_a_process_with_another_key_cannot_take_a_rank():
    from weightsync_core.api.errors import GroupInitTimeoutError

    engines = ThreadedSync(GlooCheckpointEngine, receivers=2, group_init_timeout=2)
    outsider = engines.rollout[1]
    outsider.set_session_key = lambda key: GlooCheckpointEngine.set_session_key(
        outsider, new_session_key()
    )
    _, received, _ = engines.sync({"w": torch.randn(10)})
    # the members never meet the outsider (it looks under another prefix), and it never
    # sees theirs: the group does not form, naming the rank it would have taken
    assert isinstance(received[0], GroupInitTimeoutError)
    assert received[0].missing_ranks == [2]
    assert isinstance(received[1], GroupInitTimeoutError)


def test_mismatched_bucket_sizes_are_reported():
    results = run_sync(
        GlooCheckpointEngine, {"w": torch.randn(BUCKET // 8)}, receivers=1,
        receiver_bucket=BUCKET // 4, timeout=3,
    )
    assert isinstance(results[1], TransferError)
    assert "update_weights_bucket_megabytes" in str(results[1])




def test_consumer_that_keeps_every_tensor_never_sees_them_overwritten():
    """Zero-copy receive: buffers still viewed by the consumer are not reused."""
    weights = {f"w{i}": torch.full((BUCKET // 4 // 2,), float(i)) for i in range(12)}
    results = run_sync(GlooCheckpointEngine, weights, receivers=1)
    kept = results[1]  # the receiver kept all 12 tensors (6+ buckets) alive
    for i in range(12):
        assert torch.all(kept[f"w{i}"] == i), f"w{i} was overwritten"


def test_streaming_consumer_cycles_through_two_receive_buffers_and_kept_ones_are_not_reused():
    from weightsync_core.data.bucketing import ReceiveBuffers

    buffers = ReceiveBuffers(lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8))
    held = None
    for index in range(10):
        held = buffers.take(index, 16)[:4]  # the consumer holds a view of the latest bucket
    assert buffers.allocations == 2
    kept = buffers.take(10, 16)[:2]  # a view kept: its buffer is never handed out again
    assert all(buffers.take(index, 16).data_ptr() != kept.data_ptr() for index in range(11, 15))
    del held


def test_buffers_a_staged_sync_held_are_reused_by_the_next_and_a_viewers_are_dropped():
    from weightsync_core.data.bucketing import ReceiveBuffers

    sizes = []

    def allocate(nbytes: int) -> torch.Tensor:
        sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    buffers = ReceiveBuffers(allocate)
    stage = [buffers.take(index, nbytes)[:nbytes] for index, nbytes in enumerate((100, 100, 60))]
    assert sizes == [100, 100, 60]
    stage = None  # committed: the server took its copy
    again = [buffers.take(index, nbytes)[:nbytes] for index, nbytes in enumerate((100, 50, 200))]
    assert sizes == [100, 100, 60, 200]  # the smallest free buffer that fits, else a new one
    assert buffers.kept_bytes == 460
    kept = again[0]  # the server keeps one tensor for good
    again = None
    for _ in range(ReceiveBuffers.KEPT_SYNCS):
        buffers.take(0, 10)
        assert buffers.kept_bytes == 460  # a version held as a stage, then a roll-back copy
    buffers.take(0, 10)
    assert buffers.kept_bytes == 360  # its buffer is the server's now
    del kept, stage


def test_group_is_reused_across_syncs_unless_rebuild_group():
    weights = {"w": torch.randn(1000)}
    reused = ThreadedSync(GlooCheckpointEngine, receivers=2)
    reused.sync(weights)
    first = reused.rollout[0]._group
    _, received, kwargs = reused.sync(weights)
    assert kwargs["master_metadata"][0]["reuse"] is True
    assert reused.rollout[0]._group.control is first.control  # same communicators
    assert reused.rollout[0]._group.sealer is not first.sealer  # this sync's key
    assert torch.equal(received[1]["w"], weights["w"])

    rebuilt = ThreadedSync(GlooCheckpointEngine, receivers=2, rebuild_group=True)
    rebuilt.sync(weights)
    _, received, kwargs = rebuilt.sync(weights)
    assert kwargs["master_metadata"][0]["reuse"] is False
    assert torch.equal(received[0]["w"], weights["w"])


def test_group_is_rebuilt_after_a_failed_sync():
    def failing():
        yield "a", torch.ones(10)
        raise RuntimeError("boom")

    engines = ThreadedSync(GlooCheckpointEngine, receivers=2)
    engines.sync({"w": torch.ones(3)})
    sent, _, _ = engines.sync(failing)
    assert isinstance(sent[0], RuntimeError)
    weights = {"w": torch.randn(50)}
    sent, received, kwargs = engines.sync(weights)
    assert kwargs["master_metadata"][0]["reuse"] is False
    assert all(torch.equal(r["w"], weights["w"]) for r in received)


def test_relays_widen_the_fan_out_and_deliver_bit_exact():
    weights = make_weights(seed=4, bucket_size=BUCKET)
    engines = ThreadedSync(GlooCheckpointEngine, actors=3, receivers=3, senders=2)
    sent, received, kwargs = engines.sync(weights)
    assert kwargs["rank"] == [0, 0, -1]
    assert sent[0].num_tensors == sent[1].num_tensors == len(weights)
    assert sent[2].num_tensors == 0  # idle rank only drained its stream
    for tensors in received:
        assert digests(tensors) == digests(weights)


def test_group_init_fails_fast_naming_the_ranks_that_never_arrived():
    from weightsync_core.api.errors import GroupInitTimeoutError

    engines = [GlooCheckpointEngine(BUCKET, host="127.0.0.1", group_init_timeout=2)
               for _ in range(3)]
    key = new_session_key()
    for engine in engines:
        engine.set_session_key(key)
    metadata = [engine.prepare() for engine in engines]
    actor, rollout = GlooCheckpointEngine.build_topology(1, 2, metadata)
    arguments = [{key: values[0] for key, values in actor.items()},
                 {key: values[0] for key, values in rollout.items()}]
    errors = {}

    def join(index):
        try:
            engines[index].init_process_group(**arguments[index])
        except GroupInitTimeoutError as exc:
            errors[index] = exc

    threads = [threading.Thread(target=join, args=(index,)) for index in (0, 1)]
    for thread in threads:  # group rank 2 never arrives
        thread.start()
    for thread in threads:
        thread.join(30)
    assert set(errors) == {0, 1}
    assert errors[0].missing_ranks == [2]
    assert "rank(s) [2] never arrived" in str(errors[1])


def test_buffers_released_after_each_sync_are_reallocated_for_the_next():
    engines = ThreadedSync(GlooCheckpointEngine, receivers=1, keep_buffers=False)
    for seed in (1, 2):
        weights = {"w": torch.randn(100, generator=torch.Generator().manual_seed(seed))}
        sent, received, _ = engines.sync(weights)
        assert not isinstance(sent[0], Exception), sent[0]
        assert torch.equal(received[0]["w"], weights["w"])
        assert engines.actors[0]._send_buffers == []


def test_an_actor_that_builds_a_new_engine_closes_the_one_it_replaces():
    """Whatever still refers to the old engine (a task of a failed sync, a traceback), its
    listener closes when the new engine is built, not when the last reference goes."""
    holder = ActorCheckpointEngineMixin()
    config = CheckpointEngineConfig(backend="gloo", engine_kwargs={"gloo": {"host": "127.0.0.1"}})
    holder.init_checkpoint_engine(config)
    replaced = holder.checkpoint_engine
    port = replaced.prepare()["port"]
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # listening while it is the actor's engine

    holder.init_checkpoint_engine(config)

    assert holder.checkpoint_engine is not replaced
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
