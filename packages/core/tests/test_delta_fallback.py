"""Delta sync falls back to whole tensors where a process does not hold the base, instead of
failing: after another manager's sync, and with relays (gloo ``senders=2`` or
``multi_sender``, no ``delta_group``) after a sync whose round of whole tensors had fewer
workers than senders. Real gloo groups between real Ray actors; two actor ranks on one host,
so actor rank 1 relays."""

from collections.abc import Iterator, Sequence

import pytest
import ray

from weightsync_core import CheckpointEngineConfig, CheckpointEngineManager
from weightsync_core.data.delta import DeltaPlan
from weightsync_core.orchestration.delta_ledger import DeltaLedger
from weightsync_core.orchestration.ray_group import RayRolloutReplica
from weightsync_core.testing.harness import SyncHarness

_SEED = 90
_SPARSE = 0.02


@pytest.fixture(scope="module", params=[{"senders": 2}, {"multi_sender": True}],
                ids=["senders=2", "multi_sender"])
def harness(request: pytest.FixtureRequest) -> Iterator[SyncHarness]:
    """Two actor ranks (rank 1 a relay) and three replicas of one worker each."""
    config = CheckpointEngineConfig(
        backend="gloo", update_weights_bucket_megabytes=1,
        engine_kwargs={"gloo": dict(request.param)}, sync_timeout_seconds=60,
    )
    deployment = SyncHarness(config, actor_world_size=2, replica_sizes=(1, 1, 1))
    try:
        yield deployment
    finally:
        deployment.shutdown()


class _Syncs:
    """Syncs of one weight stream (seed :data:`_SEED` after growing sparse updates), each
    checked bit-exact on the replicas synced."""

    def __init__(self, harness: SyncHarness) -> None:
        self.harness = harness
        self.updates: list[tuple[int, float]] = []

    def sync(self, manager: CheckpointEngineManager, replicas: Sequence[RayRolloutReplica],
             **options: bool) -> float:
        """One more update, synced by ``manager`` to its ``replicas``; returns the fraction
        of them that got patches."""
        step = _SEED + len(self.updates) + 1
        self.updates.append((step, _SPARSE))
        expected = self.harness.set_weights(seed=_SEED, updates=self.updates)
        metrics = manager.update_weights_sync(global_steps=step, **options)
        for index, report in enumerate(self.harness.reports(list(replicas))):
            differing = sorted(name for name in expected
                               if report["received"].get(name) != expected[name])
            assert not differing and set(report["received"]) == set(expected), (
                f"step {step}, receiver {index}: differing {differing[:5]}")
            assert report["global_steps"][-1] == step
        return metrics["weightsync/delta"]


def test_another_managers_sync_in_between_leads_to_whole_tensors_where_needed(
    harness: SyncHarness,
) -> None:
    """Manager A syncs every replica twice; manager B syncs two of them (both actor ranks
    send); A's next sync patches those two and sends whole tensors to the third, whose
    version B's sync left behind; the sync after patches all three."""
    syncs = _Syncs(harness)
    replicas = harness.replicas
    first = harness.manager(replicas, delta=True)
    assert syncs.sync(first, replicas, allow_manifest_change=True) == 0.0
    assert syncs.sync(first, replicas) == 1.0
    other = harness.manager(replicas[:2], delta=True)
    by_other = syncs.sync(other, replicas[:2])
    assert syncs.sync(first, replicas) == pytest.approx(2 / 3)
    assert syncs.sync(first, replicas) == 1.0
    assert by_other == 1.0  # B's first sync: the processes hold A's version, so patches
    assert first.stale_replicas == other.stale_replicas == []


def test_relay_without_a_share_of_the_whole_round_keeps_its_copy(
    harness: SyncHarness,
) -> None:
    """Two replicas synced (each actor rank sends to one), then a new replica: the sync
    patches the two (both ranks send) and sends whole tensors to the new one (rank 0 alone);
    the syncs after patch all three, both ranks sending."""
    syncs = _Syncs(harness)
    two = harness.replicas[:2]
    manager = harness.manager(two, delta=True)
    assert syncs.sync(manager, two, allow_manifest_change=True) == 0.0
    assert syncs.sync(manager, two) == 1.0
    newcomer = harness.new_replica(1, name="newcomer")
    try:
        manager.add_replicas([newcomer])
        every = [*two, newcomer]
        assert syncs.sync(manager, every) == pytest.approx(2 / 3)
        assert [syncs.sync(manager, every) for _ in range(3)] == [1.0, 1.0, 1.0]
    finally:
        manager.remove_replicas([newcomer])
        for worker in newcomer.workers:
            ray.kill(worker)


def test_a_relay_that_holds_no_copy_gets_whole_tensors_not_a_failure(
    harness: SyncHarness,
) -> None:
    """Actor rank 1 (a relay) restarts and holds no copy, while rank 0 and the replicas
    hold the same version: the round of patches chosen from what they report falls back to
    whole tensors once rank 1 turns out to send; the sync after patches both."""
    syncs = _Syncs(harness)
    two = harness.replicas[:2]
    assert syncs.sync(harness.manager(two, delta=True), two, allow_manifest_change=True) == 0.0
    harness.replace_actor(1)
    manager = harness.manager(two, delta=True)
    assert syncs.sync(manager, two) == 0.0
    assert syncs.sync(manager, two) == 1.0
    assert manager.stale_replicas == []


def test_the_ledger_patches_only_replicas_whose_every_worker_holds_the_actors_version():
    first, second, third = object(), object(), object()
    ledger = DeltaLedger(full_every=3)
    [(group, plan)] = ledger.rounds([first], None, [["v0"]])
    assert plan.base is None and group == [first]  # the actor side holds nothing known
    mixed = ledger.rounds([first, second, third], "v1", [["v1"], ["v1", None], []])
    assert [(group, plan.base) for group, plan in mixed] == [
        ([first], "v1"), ([second, third], None)]
    assert mixed[0][1].version == mixed[1][1].version  # one version, two rounds
    ledger.succeeded(mixed)
    ledger.succeeded([([first], DeltaPlan("v3", "v2"))])
    [(_, due)] = ledger.rounds([first], "v3", [["v3"]])
    assert due.base is None  # every 3rd sync is full
    ledger.succeeded([([first], due)])
    ledger.failed()
    [(_, after_failure)] = ledger.rounds([first], due.version, [[due.version]])
    assert after_failure.base is None
    with pytest.raises(ValueError, match="pass one list per replica"):
        ledger.rounds([first, second], "v1", [["v1"]])
