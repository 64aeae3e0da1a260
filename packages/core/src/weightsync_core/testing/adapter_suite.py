"""Conformance cases of LoRA adapter syncs (``CheckpointEngineManager.update_adapter``), for
backends that move whole tensors (not colocated, no layouts). Mix into the backend's
conformance class (one deployment serves both)::

    class TestNixlConformance(CheckpointEngineConformanceTests, AdapterSyncConformanceTests):
        backend = "nixl"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pytest
import ray

from weightsync_core.api.engine import CheckpointEngineWithCache
from weightsync_core.api.errors import SyncStageError
from weightsync_core.data.adapters import AdapterSpec
from weightsync_core.testing.harness import SyncHarness
from weightsync_core.testing.suite import _ConformanceBase
from weightsync_core.testing.weights import ONE_ELEMENT, Faults, digests, make_adapter

if TYPE_CHECKING:
    from weightsync_core.orchestration.manager import CheckpointEngineManager

__all__ = ["AdapterSyncConformanceTests", "held_adapter_versions", "set_actor_adapter"]

_SPEC = AdapterSpec("policy", 8, 16.0, ("q_proj", "v_proj"))
_SEED = 70


def set_actor_adapter(harness: SyncHarness, spec: AdapterSpec, updates: Sequence[tuple[int, float]]
                 = (), faults: Faults | None = None, ranks: Sequence[int] | None = None
                 ) -> dict[str, Any]:
    """Give the actor ranks (``ranks``: those only) adapter ``spec`` after ``updates``;
    the digests receivers should hold of it."""
    chosen = range(len(harness.actors)) if ranks is None else ranks
    ray.get([harness.actors[rank].set_adapter.remote(spec.as_dict(), _SEED, updates, faults)
             for rank in chosen])
    return digests(make_adapter(spec, _SEED, updates=updates))


def held_adapter_versions(harness: SyncHarness, name: str) -> list[dict[int, dict[str, Any]]]:
    """Per rollout worker: the versions of adapter ``name`` its server holds."""
    return [report["adapters"].get(name, {}) for report in harness.reports()]


class AdapterSyncConformanceTests(_ConformanceBase):
    """Adapter syncs end bit-exact on every worker, versioned, full or delta, never pause a
    replica, are refused before bytes move where the two ends disagree, and leave every
    replica serving what it served when they fail."""

    def _adapter_manager(self, harness: SyncHarness, **overrides: Any
                         ) -> CheckpointEngineManager:
        return harness.manager(adapter_versions=2, **overrides)

    def test_adapter_syncs_versioned_bit_exact_full_and_delta(
        self, harness: SyncHarness
    ) -> None:
        if harness.colocated:
            pytest.skip("a colocated backend takes no adapter syncs")
        before = harness.reports()
        for delta in (False, True):
            manager = self._adapter_manager(harness, delta=delta)
            name = f"{_SPEC.name}-{int(delta)}"
            spec = AdapterSpec(name, _SPEC.rank, _SPEC.alpha, _SPEC.target_modules)
            expected: dict[int, dict[str, Any]] = {}
            updates: list[tuple[int, float]] = []
            fractions = (0.0, 1.0, ONE_ELEMENT, 0.02, 0.3, 0.0, 0.02, 0.02, 0.3, 0.02)
            for step, fraction in enumerate(fractions, start=1):
                if step > 1:
                    updates.append((step, fraction))
                expected[step] = set_actor_adapter(harness, spec, updates)
                metrics = manager.update_adapter_sync(step, name)
                kept = sorted(expected)[-2:]
                for held in held_adapter_versions(harness, name):
                    assert sorted(held) == kept, f"sync {step}: versions held {sorted(held)}"
                    for version in kept:
                        assert held[version] == expected[version], (
                            f"sync {step}: version {version} differs")
                assert manager.adapter_status() == {
                    f"replica {index}": {name: kept} for index in range(len(harness.replicas))}
                assert metrics["weightsync/adapter_versions"] == len(kept)
                if delta and step > 1:
                    assert metrics["weightsync/delta"] == 1.0
                    if fraction == 0.02:
                        assert (metrics["weightsync/bytes"]
                                < 0.2 * metrics["weightsync/model_bytes"]), metrics
        if issubclass(manager.backend_cls, CheckpointEngineWithCache):  # it cached the adapter
            with pytest.raises(TypeError, match="cache holds the adapter"):
                manager.update_replicas_from_cache_sync(harness.replicas[:1], 10)
        for report, earlier in zip(harness.reports(), before, strict=True):
            assert report["lifecycle"] == earlier["lifecycle"], "an adapter sync paused a replica"
            assert report["global_steps"] == earlier["global_steps"], (
                "an adapter sync loaded weights")

    def test_adapter_refused_before_bytes_and_failure_keeps_what_served(
        self, harness: SyncHarness
    ) -> None:
        if harness.colocated:
            pytest.skip("a colocated backend takes no adapter syncs")
        spec = AdapterSpec("refusals", 8, 16.0, ("q_proj", "v_proj"))
        manager = self._adapter_manager(harness, sync_timeout_seconds=self.failure_timeout_seconds)
        first = set_actor_adapter(harness, spec)
        manager.update_adapter_sync(1, spec.name)
        status = manager.adapter_status()

        def refused(step: int, *words: str) -> None:
            with pytest.raises(SyncStageError) as caught:
                manager.update_adapter_sync(step, spec.name)
            message = str(caught.value)
            assert "check_adapter" in message and all(word in message for word in words), (
                message)
            assert manager.adapter_status() == status
            assert all(held == {1: first} for held in held_adapter_versions(harness, spec.name))

        # the actor ranks disagree: rank 1 trains rank 4
        set_actor_adapter(harness, AdapterSpec(spec.name, 4, 16.0, spec.target_modules), ranks=[1])
        refused(2, "actor_wg rank 0", "actor_wg rank 1", "rank 8", "rank 4")
        # the replicas hold rank-8 versions; the actor now trains rank 4 (or other targets)
        set_actor_adapter(harness, AdapterSpec(spec.name, 4, 8.0, spec.target_modules))
        refused(2, "rank 8", "rank 4", "rollout rank")
        set_actor_adapter(harness, AdapterSpec(spec.name, 8, 16.0, ("q_proj", "k_proj")))
        refused(2, "k_proj", "v_proj")
        # a server that cannot serve the rank refuses it, naming its limit
        worker = harness.replicas[-1].workers[-1]
        ray.get(worker.set_faults.remote(max_adapter_rank=4))
        set_actor_adapter(harness, AdapterSpec("wider", 8, 16.0, spec.target_modules))
        with pytest.raises(SyncStageError, match="max_lora_rank is 4"):
            manager.update_adapter_sync(2, "wider")
        ray.get(worker.set_faults.remote())
        # a sync that fails mid-way (a sender, then a server) leaves every replica serving
        # version 1 only, and the next sync takes
        set_actor_adapter(harness, spec, updates=[(2, 0.3)], faults=Faults(raise_after=3))
        with pytest.raises(SyncStageError, match="injected failure"):
            manager.update_adapter_sync(2, spec.name)
        assert manager.adapter_status() == status
        ray.get(worker.set_faults.remote(refuse_adapter=True))
        set_actor_adapter(harness, spec, updates=[(2, 0.3)])
        with pytest.raises(SyncStageError, match="refused version 2"):
            manager.update_adapter_sync(2, spec.name)
        assert manager.adapter_status() == status
        assert all(held == {1: first} for held in held_adapter_versions(harness, spec.name))
        second = set_actor_adapter(harness, spec, updates=[(3, 0.3)])
        manager.update_adapter_sync(3, spec.name)
        assert all(held == {1: first, 3: second}
                   for held in held_adapter_versions(harness, spec.name))
