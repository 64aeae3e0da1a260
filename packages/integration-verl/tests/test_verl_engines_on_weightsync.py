"""verl 0.9.1's own NIXL engine, its import line changed and nothing else
(:mod:`weightsync_verl.verl_engines`), through weightsync's conformance suite on CPU (UCX
over TCP), and importable beside weightsync's NIXL backend in either order."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, ClassVar

import pytest

from weightsync_core.testing import CheckpointEngineConformanceTests

UCX_OVER_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_MODULES": "^efa"}

SUITE_SWITCH = "WEIGHTSYNC_VERL_ENGINE_SUITE"
"""Set to 1 to run the suite on verl's engine: it is not in the default run, because in about
one run of four a rollout worker of verl's engine stops answering (see the README)."""


@pytest.mark.skipif(os.environ.get(SUITE_SWITCH) != "1",
                    reason=f"verl's NIXL engine through the suite: {SUITE_SWITCH}=1 runs it")
class TestVerlNixlOnWeightsync(CheckpointEngineConformanceTests):
    backend = "verl_nixl"
    engine_kwargs: ClassVar[dict[str, Any]] = {"device": "cpu"}
    ray_actor_options: ClassVar[dict[str, Any]] = {"runtime_env": {"env_vars": UCX_OVER_TCP}}
    # verl's build_topology hands a rollout side of one worker every worker's metadata
    # (nixl_checkpoint_engine.py: metadata[-rollout_world_size + 1:] is metadata[0:] then),
    # so every replica here has two workers
    replica_sizes = (2, 2)
    # found failing with verl's engine on weightsync, not yet diagnosed (see the README)
    _FAILS = "fails with verl's NIXL engine on weightsync, open: "
    skipped_cases: ClassVar[dict[str, str]] = {
        "test_replica_removed_and_another_added_between_syncs": _FAILS + "the added replica's "
            "workers receive an empty stream",
        "test_stalled_receiver_is_blamed_within_the_timeout": _FAILS + "the blame or its time "
            "differs from the suite's expectation",
        "test_frozen_receiver_is_blamed_within_the_timeout": _FAILS + "as the stalled case",
        "test_slow_receiver_past_the_timeout_is_blamed": _FAILS + "as the stalled case",
        "test_receiver_that_dies_is_blamed_then_survivors_sync": _FAILS + "the survivors' sync "
            "after removing the dead replica fails",
        "test_sender_that_dies_is_blamed": _FAILS + "the next sync times out at "
            "abort_requests waiting on a replica",
        "test_soak_keeps_resources_flat_and_close_frees_every_port": _FAILS + "close() ends in "
            "NIXL's deregisterMem refusing verl's arguments",
        "test_one_rollout_worker": "verl 0.9.1's NIXL build_topology gives a one-worker "
                                   "rollout side every worker's metadata",
        "test_corrupted_bucket_is_refused_and_blames_its_sender": "verl's engines checksum "
                                                                  "nothing: corruption cannot "
                                                                  "be detected",
    }

    @classmethod
    def make_config(cls, **overrides: Any):
        overrides.setdefault("custom_backend_module", "weightsync_verl.verl_nixl")
        return super().make_config(**overrides)


@pytest.mark.parametrize("first", ["weightsync_nixl", "weightsync_verl.verl_nixl"])
def test_verls_nixl_engine_imports_beside_weightsyncs_in_either_order(first: str) -> None:
    second = ({"weightsync_nixl", "weightsync_verl.verl_nixl"} - {first}).pop()
    check = (
        f"import {first}, {second}\n"
        "from weightsync_core import CheckpointEngineRegistry as registry\n"
        "print(registry.get('nixl').__module__, registry.get('verl_nixl').__module__)\n"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [
        "weightsync_nixl.engine", "weightsync_verl.on_weightsync.nixl_checkpoint_engine",
    ]
