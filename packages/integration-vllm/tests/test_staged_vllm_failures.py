"""The staged syncs' failure matrix into vLLM's AsyncLLM with a generating client (real Ray
actors, real gloo, real vLLM): a killed sender, a killed receiver, a corrupted bucket, a
refused tensor and a timeout, in phase 1 (staging) and in phase 2 (the switch).

Each sync goes to two replicas: vLLM (a client generates on it all the time) and a
bystander (core's recording worker, a second replica: the one killed or stalled where the
receiver fails, as vLLM's own process dying would leave no client to check). In every case
the client gets no error; every answer is the greedy tokens of one whole version (Hugging
Face's on the sender's weights), the old one until vLLM switched, the new one after (a
request in flight at a ``keep`` switch continues on the new weights with the KV cache it
has: at most one answer, between the two); vLLM serves its old version (phase 1) or the one
it was rolled back to or took whole (phase 2), answers within 1 s of the failure, reports
that version, and the next sync gives Hugging Face's tokens again."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
import ray
import torch
from vllm_sync_support import running_rollout, sync_config
from vllm_test_actors import ProbedStagedWorker

from weightsync_core import (
    CheckpointEngineManager,
    RayRolloutReplica,
    RayWorkerGroup,
    SyncStageError,
)
from weightsync_core.testing.actors import RecordingRolloutWorker
from weightsync_core.testing.weights import Faults

PROMPTS = torch.randint(0, 8192, (2, 6), generator=torch.Generator().manual_seed(11))
NEW_TOKENS = 6
TIMEOUT = 30.0
"""The manager's timeout for the syncs that do not fail by one."""
VERSIONS = itertools.count(700)


@dataclass(frozen=True)
class Case:
    """A fault: who gets it (``"sender"``, ``"vllm"`` or ``"bystander"``), what it is, in
    which phase; ``stage`` is the failed sync's (None: the sync succeeds), ``takes_new``
    whether vLLM ends on the new version, ``timeout`` the manager's."""

    fault: str
    target: str
    phase: int
    stage: str | None
    takes_new: bool = False
    timeout: float = TIMEOUT


CASES = {
    "killed sender, phase 1": Case("die", "sender", 1, "transfer"),
    "corrupted bucket, phase 1": Case("corrupt", "sender", 1, "transfer"),
    "refused tensor, phase 1": Case("unknown name", "vllm", 1, "transfer"),
    "timeout, phase 1": Case("stall", "bystander", 1, "transfer", timeout=8.0),
    "killed receiver, phase 1": Case("die", "bystander", 1, "transfer"),
    "killed sender, phase 2": Case("die", "sender", 2, None, takes_new=True),
    "refused switch, phase 2": Case("refuse", "vllm", 2, "commit"),
    "timeout, phase 2": Case("stall", "vllm", 2, "commit", timeout=8.0),
    "killed receiver, phase 2": Case("die", "bystander", 2, "commit", takes_new=True),
}


class Deployment:
    """The sender, vLLM and the bystander; ``served`` the greedy tokens of the version vLLM
    serves, ``version`` that version."""

    def __init__(self, source: Any, rollout: Any) -> None:
        self.source, self.rollout = source, rollout
        self.bystander = self._bystander()
        self.version = next(VERSIONS)
        self.served = source.perturb(PROMPTS, NEW_TOKENS)
        self.manager().update_weights(self.version)

    @staticmethod
    def _bystander() -> Any:
        return ray.remote(num_cpus=0)(RecordingRolloutWorker).remote(sync_config("gloo"))

    def manager(self, timeout: float = TIMEOUT) -> CheckpointEngineManager:
        """A manager of syncs from the sender into vLLM and the bystander (two replicas)."""
        config = dataclasses.replace(sync_config("gloo"), sync_timeout_seconds=timeout)
        ray.get([self.source.actor.init_checkpoint_engine.remote(config),
                 self.source.actor.set_faults.remote(Faults()),
                 self.rollout.set_checkpoint_engine.remote(config)])
        return CheckpointEngineManager(config, RayWorkerGroup([self.source.actor]),
                                       [RayRolloutReplica([self.rollout], name="vllm"),
                                        RayRolloutReplica([self.bystander], name="bystander")])

    def replace_bystander(self) -> None:
        ray.kill(self.bystander)
        self.bystander = self._bystander()

    def sync_whole(self) -> None:
        """The next sync after a failure: vLLM gives Hugging Face's tokens on it."""
        self.version = next(VERSIONS)
        self.served = self.source.perturb(PROMPTS, NEW_TOKENS)
        metrics = self.manager().update_weights(self.version)
        assert metrics["weightsync/staged"] == 1.0
        assert torch.equal(_generate(self.rollout), self.served)
        status = self.manager().weights_status()
        assert {name: (s["state"], s["version"]) for name, s in status.items()} == {
            "replica 0": ("serving", self.version), "replica 1": ("serving", self.version)}


def _generate(rollout: Any) -> torch.Tensor:
    return ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, 0))


class _Client:
    """Requests to ``rollout``, one after another on a thread, until stopped: each answer
    with the time it came, and what any request raised."""

    def __init__(self, rollout: Any) -> None:
        self.rollout = rollout
        self.answers: list[tuple[float, torch.Tensor]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                tokens = _generate(self.rollout)
                self.answers.append((time.monotonic(), tokens))
            except Exception as error:
                self.errors.append(error)

    def __enter__(self) -> _Client:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(1.0)  # answers after the failure too
        self._stop.set()
        self._thread.join(60)


@pytest.fixture(scope="module")
def deployment(model_path, source):
    with running_rollout(ProbedStagedWorker, model_path) as rollout:
        served = Deployment(source, rollout)
        yield served
        ray.kill(served.bystander)


def _inject(served: Deployment, case: Case) -> None:
    """Set ``case``'s fault (phase 1: before the sync; phase 2: once the stage is whole,
    but a refused switch before the sync: vLLM's worker prepares its switch in phase 1)."""
    sender, bystander = served.source.actor, served.bystander
    if (case.target, case.fault) == ("sender", "die"):
        if case.phase == 1:
            ray.get(sender.set_faults.remote(Faults(die_after=5)))
        else:
            ray.kill(sender)
    elif case.fault == "corrupt":
        ray.get(sender.corrupt_checksum.remote(0))
    elif case.fault == "unknown name":
        ray.get(sender.set_faults.remote(Faults(rename="model.layers.0.mlp.up_proj.weight")))
    elif case.target == "bystander":
        fault = "die_after" if case.fault == "die" else "stall_after"
        ray.get(bystander.set_faults.remote(**{fault: 2 if case.phase == 1 else 0}))
    elif case.fault == "refuse":
        ray.get(served.rollout.refuse_next_commit.remote(0))
    else:
        ray.get(served.rollout.hang_in_next_pause.remote())


def _failing_sync(served: Deployment, case: Case, version: int) -> SyncStageError | None:
    """The sync of ``version`` with ``case``'s fault; the error it raised, if any."""
    manager = served.manager(case.timeout)
    before_stage = case.phase == 1 or case.fault == "refuse"
    try:
        if before_stage:
            _inject(served, case)
        if case.phase == 1:
            manager.update_weights(version)
        else:
            async def both_phases() -> None:
                await manager.stage_weights(global_steps=version)
                if not before_stage:
                    _inject(served, case)
                await manager.commit_weights()

            asyncio.run(both_phases())
    except SyncStageError as error:
        return error
    return None


def _check_answers(answers: list[tuple[float, torch.Tensor]], old: torch.Tensor,
                   new: torch.Tensor, takes_new: bool) -> None:
    """Every answer is ``old``'s tokens, then (where vLLM took the new version) at most one
    answer in flight at the switch, then ``new``'s."""
    kinds = ["old" if torch.equal(tokens, old) else "new" if torch.equal(tokens, new)
             else "in flight" for _, tokens in answers]
    assert answers, "the client was not served"
    if not takes_new:
        assert set(kinds) == {"old"}, kinds
        return
    switched = [kind for kind in kinds if kind != "old"]
    assert switched[:1] in (["new"], ["in flight"]) and set(switched[1:]) <= {"new"}, kinds


@pytest.mark.parametrize("name", list(CASES))
def test_a_failed_staged_sync_leaves_vllm_serving_a_whole_version(deployment, name):
    case, served = CASES[name], deployment
    old, old_version = served.served, served.version
    new_version = next(VERSIONS)
    new = served.source.perturb(PROMPTS, NEW_TOKENS)
    assert not torch.equal(old, new)  # the versions' answers tell them apart
    with _Client(served.rollout) as client:
        time.sleep(0.1)
        error = _failing_sync(served, case, new_version)
        failed_at = time.monotonic()

    if case.stage is None:
        assert error is None, error
    else:
        assert error is not None and error.stage == case.stage, (error, case)
        if not case.takes_new:
            assert "committed" in str(error) or "rolled back" in str(error), str(error)
    assert client.errors == []
    _check_answers(client.answers, old, new, case.takes_new)
    assert any(failed_at <= at <= failed_at + 1.0 for at, _ in client.answers), (
        "no answer within 1 s of the failure")
    expected, expected_version = (new, new_version) if case.takes_new else (old, old_version)
    assert torch.equal(_generate(served.rollout), expected)
    status = ray.get(served.rollout.weights_status.remote())
    assert (status["version"], status["complete"], status["staged_version"]) == (
        expected_version, True, None), status
    assert not ray.get(served.rollout.engine_paused.remote())

    if case.target == "sender" and case.fault == "die":
        served.source.restart()
    if case.target == "bystander":
        served.replace_bystander()
    served.sync_whole()
