"""Conformance cases of sharded delivery, for backends whose engine sets
``executes_layouts``: FSDP-style actor ranks into tensor-parallel replicas, dense and
mixture-of-experts (experts split by tensor or by expert). Mix into the
backend's conformance class (one deployment serves both)::

    class TestShardedGlooConformance(CheckpointEngineConformanceTests,
                                     ShardedDeliveryConformanceTests):
        backend = "gloo_sharded"
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest
import ray

from weightsync_core.api.config import parse_dtype
from weightsync_core.api.errors import SyncStageError
from weightsync_core.data.adapters import AdapterSpec
from weightsync_core.data.bucketing import cast_for_rollout
from weightsync_core.data.delta.patch import PATCH_HEADER_BYTES
from weightsync_core.data.shards.specs import (
    LayoutSpec,
    fsdp_spec,
    moe_spec,
    resolve_layout,
    tensor_parallel_spec,
)
from weightsync_core.data.shards.tensor_parallel import DecoderShape
from weightsync_core.orchestration.ray_group import RayRolloutReplica
from weightsync_core.testing.adapter_suite import held_adapter_versions, set_actor_adapter
from weightsync_core.testing.harness import SyncHarness
from weightsync_core.testing.suite import _ConformanceBase
from weightsync_core.testing.weights import (
    DECODER,
    MOE,
    ONE_ELEMENT,
    Faults,
    TensorDigest,
    digest,
    make_weights,
    sparse_updates,
)

__all__ = ["ShardedDeliveryConformanceTests"]

_PROFILE = "decoder"
_DELTA_SEED = 90
_SPARSE = 0.02


class ShardedDeliveryConformanceTests(_ConformanceBase):
    """Every rollout worker receives exactly the boxes its layout declares, bit-exact, from
    the actor ranks that hold those rows; a sender that dies is named."""

    case_processes: ClassVar[Mapping[str, Sequence[tuple[str, int]]]] = {
        "test_sharded_added_tp_replica_gets_its_slices": (("replica", 2),),
        "test_sharded_moe_into_tp_and_ep_replicas": (("replica", 2),),
        "test_sharded_sender_that_dies_is_blamed": (("actor", 1),),
        "test_sharded_delta_syncs_of_slices_bit_exact_and_move_less": (("replica", 2),),
    }

    moe_storage: ClassVar[str] = "moe_fused"
    """How the actor ranks of the mixture-of-experts case hold the experts: ``moe_fused``
    (transformers 5's fused tensors, streamed per expert) or ``moe`` (one tensor per
    expert, FSDP rows of each)."""

    @staticmethod
    def _worker_layouts(harness: SyncHarness, replicas: Sequence[RayRolloutReplica]
                        ) -> list[LayoutSpec | None]:
        """A replica of one worker takes every tensor whole; one of more is tensor parallel
        across its workers."""
        return [None if len(replica.workers) == 1 else
                tensor_parallel_spec(DECODER, len(replica.workers), rank)
                for replica in replicas for rank in range(len(replica.workers))]

    @contextlib.contextmanager
    def _sharded(self, harness: SyncHarness, replicas: Sequence[RayRolloutReplica],
                 layouts: Sequence[LayoutSpec | None] | None = None,
                 fused_experts: bool = False) -> Iterator[list[LayoutSpec | None]]:
        """FSDP rows on the actor ranks (``fused_experts``: of a model holding its experts
        fused, streamed per expert), tensor-parallel layouts on ``replicas`` (or
        ``layouts``, one per worker); everything whole again afterwards, on the replicas
        then in ``replicas`` (a case removes a replica it killed)."""
        size = len(harness.actors)
        layouts = list(layouts or self._worker_layouts(harness, replicas))
        workers = [worker for replica in replicas for worker in replica.workers]
        ray.get([actor.set_layout.remote(fsdp_spec(size, rank, fused_experts))
                 for rank, actor in enumerate(harness.actors)])
        ray.get([worker.set_layout.remote(layout)
                 for worker, layout in zip(workers, layouts, strict=True)])
        try:
            yield layouts
        finally:
            ray.get([actor.set_layout.remote(None) for actor in harness.actors])
            ray.get([worker.set_layout.remote(None)
                     for replica in replicas for worker in replica.workers])
            # the deployment's other cases expect the standard weights, whole, everywhere
            expected = harness.set_weights(seed=70)
            harness.manager(replicas).update_weights_sync(global_steps=70,
                                                          allow_manifest_change=True)
            self.assert_delivered(harness, expected, replicas)

    def _expected(self, harness: SyncHarness, seed: int,
                  layouts: Sequence[LayoutSpec | None], profile: str = _PROFILE,
                  updates: Sequence[tuple[int, float]] = ()
                  ) -> list[dict[str, TensorDigest]]:
        """What each worker of ``layouts`` must receive: the digests of its boxes of the
        weights of ``profile`` (``moe_fused`` streams as ``moe``) after ``updates``."""
        dtype = parse_dtype(harness.config.rollout_dtype)
        streamed = "moe" if profile == "moe_fused" else profile
        made = make_weights(seed, harness.config.bucket_size_bytes, streamed)
        weights = {name: cast_for_rollout(tensor, dtype)
                   for name, tensor in sparse_updates(made, updates).items()}
        shapes = {name: tuple(tensor.shape) for name, tensor in weights.items()}
        expected = []
        for index, spec in enumerate(layouts):
            layout = resolve_layout(spec, shapes, f"rollout rank {index}")
            expected.append({name: digest(box.cut(weights[name]).contiguous())
                             for name, box in layout.boxes.items()})
        return expected

    def _sync_and_check(self, harness: SyncHarness, manager: Any, seed: int,
                        replicas: Sequence[RayRolloutReplica],
                        layouts: Sequence[LayoutSpec | None],
                        allow_manifest_change: bool = False, profile: str = _PROFILE,
                        updates: Sequence[tuple[int, float]] = ()) -> dict[str, float]:
        """Sync the weights of ``profile`` (``decoder`` by default) of ``seed`` after
        ``updates`` (``allow_manifest_change``: the first sync of a case, whose workers held
        other tensors before); check every worker."""
        harness.set_weights(seed=seed, profile=profile, updates=updates)
        metrics = manager.update_weights_sync(global_steps=seed + len(updates),
                                              allow_manifest_change=allow_manifest_change)
        reports = harness.reports(replicas)
        expected_boxes = self._expected(harness, seed, layouts, profile, updates)
        for index, (report, expected) in enumerate(zip(reports, expected_boxes, strict=True)):
            assert report["received"] == expected, (
                f"rollout rank {index} ({layouts[index]}): received "
                f"{sorted(report['received'])[:3]}..., differing "
                f"{[n for n in expected if report['received'].get(n) != expected[n]][:5]}")
        return metrics

    def test_sharded_fsdp_ranks_into_tp_replicas_bit_exact(self, harness: SyncHarness
                                                           ) -> None:
        """2 FSDP ranks into a whole-model replica and a TP=2 replica, three syncs: every
        worker gets exactly its slices (the vocabulary padded as vLLM pads it, norms of 33
        rows split 17/16 between the senders, the embedding in several chunks); the TP
        workers receive about half the bytes; every actor rank sends."""
        replicas = harness.replicas
        manager = harness.manager()
        with self._sharded(harness, replicas) as layouts:
            for seed in (71, 72, 73):
                metrics = self._sync_and_check(harness, manager, seed, replicas, layouts,
                                               allow_manifest_change=seed == 71)
            sent = ray.get([actor.report.remote() for actor in harness.actors])
            sizes = [sum(_nbytes(entry) for entry in report["received"].values())
                     for report in harness.reports(replicas)]
        assert all(report["weight_streams"] > 0 for report in sent)
        whole = sizes[0]
        assert all(0.4 * whole < size < 0.6 * whole for size in sizes[1:]), sizes
        # the most any worker received; the actor ranks sent each distinct box once (the
        # norms, which every worker needs whole, go on from worker to worker)
        assert metrics["weightsync/bytes"] == max(sizes)
        assert metrics["weightsync/bytes_sent"] == _distinct_bytes(
            self._expected(harness, 73, layouts))

    def test_sharded_added_tp_replica_gets_its_slices(self, harness: SyncHarness) -> None:
        """A TP=2 replica added later receives its slices in the next two syncs, with the
        others; the workers of the two TP=2 replicas relay the slices they share, so the
        actor ranks send each distinct slice once."""
        added = harness.new_replica(2)
        replicas = [*harness.replicas, added]
        manager = harness.manager(replicas)
        try:
            with self._sharded(harness, replicas) as layouts:
                for seed in (74, 77):
                    metrics = self._sync_and_check(harness, manager, seed, replicas, layouts,
                                                   allow_manifest_change=seed == 74)
                expected = self._expected(harness, 77, layouts)
        finally:
            for worker in added.workers:
                ray.kill(worker)
        assert metrics["weightsync/bytes_sent"] == _distinct_bytes(expected)

    def test_sharded_moe_into_tp_and_ep_replicas(self, harness: SyncHarness) -> None:
        """A mixture-of-experts model whose actor ranks hold its experts as
        :attr:`moe_storage` says (fused: FSDP2 rows of ``gate_up_proj`` [E, 2I, H], whole
        experts, streamed per expert as views; per expert: FSDP rows of each expert's
        tensors) into the replicas (one of one worker: the whole model; of two: TP=2,
        each expert's gate/up rows and down
        columns halved) and an added EP=2 replica (experts 0-1 on one worker, 2-3 on the
        other, attention still tensor-parallel), two syncs: every worker gets exactly its
        slices; the actor ranks send each distinct slice once."""
        added = harness.new_replica(2)
        replicas = [*harness.replicas, added]
        layouts = [None if len(replica.workers) == 1 else
                   moe_spec(MOE, len(replica.workers), rank, expert_parallel=replica is added)
                   for replica in replicas for rank in range(len(replica.workers))]
        manager = harness.manager(replicas)
        try:
            with self._sharded(harness, replicas, layouts,
                               fused_experts=self.moe_storage == "moe_fused"):
                for seed in (81, 82):
                    metrics = self._sync_and_check(harness, manager, seed, replicas, layouts,
                                                   allow_manifest_change=seed == 81,
                                                   profile=self.moe_storage)
                expected = self._expected(harness, 82, layouts, self.moe_storage)
        finally:
            for worker in added.workers:
                ray.kill(worker)
        experts = [{name for name in boxes if ".experts." in name} for boxes in expected]
        whole = [index for index, spec in enumerate(layouts) if spec is None]
        assert all(len(experts[index]) == 3 * MOE.num_experts for index in whole)
        assert experts[-2].isdisjoint(experts[-1]) and len(experts[-1]) == 6  # EP: 2 each
        assert all(len(names) == 3 * MOE.num_experts for names in experts[:-2])  # TP: all
        assert metrics["weightsync/bytes_sent"] == _distinct_bytes(expected)

    def test_sharded_mismatched_geometry_is_refused_at_prepare(self, harness: SyncHarness
                                                               ) -> None:
        """The last worker of a TP replica declares a geometry that is not the checkpoint's
        (head_dim, intermediate size, vocabulary, KV heads, one at a time): each sync is
        refused at prepare, before any byte moves, naming that worker as the manager numbers
        it and the first tensor its slices do not fit; every replica keeps serving the
        weights it had (resumed, not stale); with the right geometry the next sync delivers
        every slice."""
        replicas = harness.replicas
        if all(len(replica.workers) < 2 for replica in replicas):
            pytest.skip("no tensor-parallel replica (replica_sizes has no replica of 2+)")
        index = max(i for i, replica in enumerate(replicas) if len(replica.workers) > 1)
        size = len(replicas[index].workers)
        rank = sum(len(replica.workers) for replica in replicas[:index + 1]) - 1
        worker = replicas[index].workers[-1]
        name = f"rollout rank {rank} (replica {index}, worker {size - 1})"
        manager = harness.manager()
        with self._sharded(harness, replicas) as layouts:
            self._sync_and_check(harness, manager, 78, replicas, layouts,
                                 allow_manifest_change=True)
            served = [report["received"] for report in harness.reports(replicas)]
            for field, value, tensor in (
                    ("head_dim", 2 * DECODER.head_dim, "model.layers.0.self_attn.q_proj.weight"),
                    ("intermediate_size", 2 * DECODER.intermediate_size,
                     "model.layers.0.mlp.gate_proj.weight"),
                    ("vocab_size", 128, "model.embed_tokens.weight"),
                    ("num_key_value_heads", 1, "model.layers.0.self_attn.k_proj.weight")):
                wrong = DecoderShape(**{**vars(DECODER), field: value})
                ray.get(worker.set_layout.remote(tensor_parallel_spec(wrong, size, size - 1)))
                harness.set_weights(seed=79, profile=_PROFILE)
                with pytest.raises(SyncStageError) as info:
                    manager.update_weights_sync(global_steps=79)
                message = str(info.value)
                assert info.value.stage == "prepare", message
                assert info.value.worker == name, message
                assert f"tensor {tensor!r} has shape" in message, message
                assert "declared geometry gives it" in message, message
                assert not manager.stale_replicas, message
                reports = harness.reports(replicas)
                assert [report["received"] for report in reports] == served, field
                for report in reports:
                    assert report["global_steps"][-1] == 78, (field, report["global_steps"])
                    assert report["lifecycle"][-1] == "resume_generation", report["lifecycle"]
            ray.get(worker.set_layout.remote(layouts[rank]))
            self._sync_and_check(harness, manager, 80, replicas, layouts)

    def test_sharded_sender_that_dies_is_blamed(self, harness: SyncHarness) -> None:
        """Actor rank 1 dies after a few of its shards: the sync fails within its timeout,
        naming it; after it is replaced, the next sync delivers every slice."""
        replicas = harness.replicas
        with self._sharded(harness, replicas) as layouts:
            harness.set_weights(seed=75, profile=_PROFILE)
            ray.get(harness.actors[1].set_weights.remote(75, _PROFILE, Faults(die_after=5)))
            manager = harness.manager(sync_timeout_seconds=self.failure_timeout_seconds)
            try:
                with pytest.raises(SyncStageError) as info:
                    # (the workers hold the other cases' weights: without allow_manifest_change
                    # they refuse the first tensor, which raced the sender's death)
                    manager.update_weights_sync(global_steps=75, allow_manifest_change=True)
            finally:
                harness.replace_actor(1)
            assert info.value.worker == "actor_wg rank 1", str(info.value)
            ray.get(harness.actors[1].set_layout.remote(fsdp_spec(len(harness.actors), 1)))
            self._sync_and_check(harness, harness.manager(), 76, replicas, layouts,
                                 allow_manifest_change=True)

    def test_sharded_adapter_syncs_go_whole_beside_the_base_slices(
            self, harness: SyncHarness) -> None:
        """FSDP rows on the actor ranks, a whole-model and a TP=2 replica: LoRA adapter syncs
        (three full, then three delta) deliver every worker the whole adapter, bit-exact,
        the newest two versions kept; a base sync after them still gives each worker
        exactly its slices."""
        replicas = harness.replicas
        with self._sharded(harness, replicas) as layouts:
            self._sync_and_check(harness, harness.manager(), 74, replicas, layouts,
                                 allow_manifest_change=True)
            for delta in (False, True):
                manager = harness.manager(adapter_versions=2, delta=delta)
                spec = AdapterSpec(f"sharded-{int(delta)}", 4, 8.0, ("q_proj", "v_proj"))
                expected = {}
                updates: list[tuple[int, float]] = []
                for step, fraction in enumerate((1.0, 0.3, _SPARSE), start=1):
                    if step > 1:
                        updates.append((step, fraction))
                    expected[step] = set_actor_adapter(harness, spec, updates)
                    metrics = manager.update_adapter_sync(step, spec.name)
                    if delta:  # patches from the second sync on
                        assert metrics["weightsync/delta"] == float(step > 1), (step, metrics)
                for worker, held in enumerate(held_adapter_versions(harness, spec.name)):
                    assert sorted(held) == [2, 3], f"rollout rank {worker} holds {sorted(held)}"
                    assert all(held[step] == expected[step] for step in (2, 3)), (
                        f"rollout rank {worker} ({layouts[worker]}): adapter differs")
            self._sync_and_check(harness, harness.manager(), 75, replicas, layouts)

    def test_sharded_delta_syncs_of_slices_bit_exact_and_move_less(
            self, harness: SyncHarness) -> None:
        """``delta=True`` with 2 FSDP ranks into the replicas and an added TP=2 replica
        (the two TP=2 replicas' workers relay the slices they share): a full sync, then ten
        delta syncs (nothing, everything, one element, 2% and 30% of every tensor) deliver
        every worker's slices bit-exact as patches, a 2% sync moving under a fifth of the
        bytes and one of nothing headers only. A worker whose copy of its slices was
        tampered with is caught and named; a sync cut short by a failing actor rank, and
        one by a worker that dies mid-delta, leave no one claiming a version: each is
        followed by a full sync, bit-exact, then patches again."""
        added = harness.new_replica(2)
        replicas = [*harness.replicas, added]
        manager = harness.manager(replicas, delta=True,
                                  sync_timeout_seconds=self.failure_timeout_seconds)
        updates: list[tuple[int, float]] = []

        def sync(fraction: float | None, allow_manifest_change: bool = False
                 ) -> dict[str, float]:
            if fraction is not None:
                updates.append((_DELTA_SEED + len(updates) + 1, fraction))
            return self._sync_and_check(harness, manager, _DELTA_SEED, replicas,
                                        layouts[:sum(len(r.workers) for r in replicas)],
                                        allow_manifest_change, updates=updates)

        try:
            with self._sharded(harness, replicas) as layouts:
                assert sync(None, allow_manifest_change=True)["weightsync/delta"] == 0.0
                for fraction in (0.0, 1.0, ONE_ELEMENT, _SPARSE, 0.3, 0.0, _SPARSE, _SPARSE,
                                 0.3, _SPARSE):
                    metrics = sync(fraction)
                    assert metrics["weightsync/delta"] == 1.0, (fraction, metrics)
                    moved, model = metrics["weightsync/bytes"], metrics["weightsync/model_bytes"]
                    if fraction == 0.0:  # headers only: one a piece, at most one a tensor
                        pieces = metrics["weightsync/tensors"] * len(harness.actors) * len(
                            layouts)  # from each actor rank to each worker
                        assert moved % PATCH_HEADER_BYTES == 0, moved
                        assert moved <= PATCH_HEADER_BYTES * pieces, (moved, pieces)
                    elif fraction == _SPARSE:
                        assert moved < model / 5, (moved, model)
                self._tampered_copy_is_caught_then_healed(harness, manager, added, sync)
                self._failed_delta_then_full(harness, manager, replicas, updates, sync,
                                             Faults(raise_after=5))
                ray.get(added.workers[-1].set_faults.remote(die_after=3))
                self._failed_delta_then_full(harness, manager, replicas, updates, sync)
        finally:
            for worker in added.workers:
                ray.kill(worker)

    @staticmethod
    def _tampered_copy_is_caught_then_healed(harness: SyncHarness, manager: Any,
                                             added: RayRolloutReplica, sync: Any) -> None:
        """A bit flipped in the last worker's copy of its slice of the embedding: the next
        delta sync fails naming it and the tensor; the one after is full for everyone."""
        victim = added.workers[-1]
        ray.get(victim.tamper_delta_baseline.remote("model.embed_tokens.weight"))
        with pytest.raises(SyncStageError, match=r"'model\.embed_tokens\.weight' rebuilt "
                           r"from its delta .* not the sender's") as info:
            sync(_SPARSE)
        workers = [worker for replica in manager.replicas for worker in replica.workers]
        assert info.value.worker is not None and info.value.worker.startswith(
            f"rollout rank {workers.index(victim)} "), str(info.value)
        assert sync(None)["weightsync/delta"] == 0.0
        assert not manager.stale_replicas

    @staticmethod
    def _failed_delta_then_full(harness: SyncHarness, manager: Any,
                                replicas: list[RayRolloutReplica],
                                updates: list[tuple[int, float]], sync: Any,
                                faults: Faults | None = None) -> None:
        """A delta sync fails mid-way (the actor ranks raise after ``faults``, else the
        last replica's last worker dies, set up by the caller): no worker left claims a
        version; a dead worker's replica is stale (stop-the-world) and is removed; the next
        sync to the rest is full and bit-exact, the one after patches again."""
        harness.set_weights(seed=_DELTA_SEED, profile=_PROFILE,
                            updates=[*updates, (_DELTA_SEED + 99, _SPARSE)], faults=faults)
        with pytest.raises(SyncStageError) as info:
            manager.update_weights_sync(global_steps=_DELTA_SEED + 99)
        if faults is None:
            dead = replicas.pop()
            workers = [worker for replica in manager.replicas for worker in replica.workers]
            assert info.value.worker is not None and info.value.worker.startswith(
                f"rollout rank {workers.index(dead.workers[-1])} "), str(info.value)
            assert manager.stages_syncs() or [id(r) for r in manager.stale_replicas] == [
                id(dead)], str(info.value)
            manager.remove_replicas([dead])
        else:
            assert "injected failure" in str(info.value), str(info.value)
        statuses = ray.get([worker.weights_status.remote()
                            for replica in replicas for worker in replica.workers])
        assert all(status["delta_version"] is None for status in statuses), statuses
        assert sync(_SPARSE)["weightsync/delta"] == 0.0
        assert sync(_SPARSE)["weightsync/delta"] == 1.0


def _distinct_bytes(expected: Sequence[Mapping[str, TensorDigest]]) -> int:
    """The bytes of every distinct box the workers of ``expected`` receive, each once."""
    distinct = {(name, entry) for boxes in expected for name, entry in boxes.items()}
    return sum(_nbytes(entry) for _, entry in distinct)


def _nbytes(entry: TensorDigest) -> int:
    shape, dtype, _ = entry
    return math.prod(shape) * parse_dtype(dtype).itemsize  # type: ignore[union-attr]
