"""Who a stalled sync blames, from what each process reports (no Ray needed)."""

from __future__ import annotations

from weightsync_core.api.engine import SyncProgress
from weightsync_core.orchestration.blame import (
    STUCK_WAIT_SECONDS,
    settings_mismatch,
    stalled_processes,
)

NAMES = ["actor_wg rank 0", "rollout rank 0 (replica 0, worker 0)",
         "rollout rank 1 (replica 1, worker 0)", "rollout rank 2 (replica 2, worker 0)"]


def _report(
    state: str = "receiving", seconds: float = 20.0, waiting=(), tensors: int = 3
) -> dict:
    return {"state": state, "seconds": seconds, "tensors": tensors, "waiting": [
        {"peer": peer, "what": what, "seconds": waited} for peer, what, waited in waiting
    ]}


def test_a_progress_snapshot_lists_outstanding_waits_oldest_first() -> None:
    progress = SyncProgress()
    with progress.waiting_on("rollout rank 1", "waiting for its hello"):
        with progress.waiting_on("rollout rank 2", "writing bucket 0"):
            waits = progress.snapshot()["waiting"]
        assert [w["peer"] for w in waits] == ["rollout rank 1", "rollout rank 2"]
        assert waits[0]["seconds"] >= waits[1]["seconds"]
    assert progress.snapshot()["waiting"] == []


def test_the_pair_across_a_cut_path_is_blamed_first() -> None:
    # a partition between rollout ranks 0 and 1 of a ring, as measured on the testbed: rank
    # 0 waits on rank 1 (its hello), rank 1 on rank 0 (a bucket); rank 0's slots stay full,
    # so the actor waits on rank 0 for a slot (from the start) while rank 0 waits on the
    # actor for its next bucket: two waiting pairs, and rank 1 got nothing through
    waited = STUCK_WAIT_SECONDS + 15
    reports = {
        NAMES[0]: _report("sending", tensors=40,
                          waiting=[("rollout rank 0", "a free slot for bucket 2", waited + 1)]),
        NAMES[1]: _report(tensors=30, waiting=[("rollout rank 1", "waiting for its hello",
                                                waited),
                                               ("actor rank 0", "waiting for bucket 2", waited)]),
        NAMES[2]: _report(tensors=0, waiting=[("rollout rank 0", "waiting for bucket 0",
                                               waited)]),
        NAMES[3]: _report(tensors=0, waiting=[("rollout rank 1", "waiting for bucket 0",
                                               waited)]),
    }
    culprits = stalled_processes(reports, NAMES)
    assert [culprit.name for culprit in culprits] == [NAMES[1], NAMES[0]]
    assert NAMES[2] in culprits[0].verdict and "network between their hosts" in culprits[0].verdict


def test_silent_and_stuck_processes_come_before_a_waiting_pair() -> None:
    waited = STUCK_WAIT_SECONDS + 5
    reports = {
        NAMES[1]: _report(waiting=[("rollout rank 1", "writing bucket 2", waited)]),
        NAMES[2]: _report("loading", waiting=[("rollout rank 0", "waiting for bucket 3",
                                               waited)]),
        NAMES[3]: None,
    }
    names = [culprit.name for culprit in stalled_processes(reports, NAMES)]
    assert names == [NAMES[3], NAMES[2], NAMES[1]]


def test_short_waits_blame_nobody() -> None:
    short = STUCK_WAIT_SECONDS / 2
    reports = {
        NAMES[1]: _report(waiting=[("rollout rank 1", "writing bucket 2", short)]),
        NAMES[2]: _report(waiting=[("rollout rank 0", "waiting for bucket 3", short)]),
    }
    assert stalled_processes(reports, NAMES) == []


def test_without_a_mutual_wait_the_process_others_wait_on_at_the_edge_is_blamed() -> None:
    # the same partition, but rank 0 got rank 1's hello and is connecting to it (a call
    # that may mark no wait): rank 1 got nothing from rank 0, rank 2 nothing from rank 1
    waited = STUCK_WAIT_SECONDS + 15
    reports = {
        NAMES[0]: _report("sending", tensors=16,
                          waiting=[("rollout rank 0", "a free slot for bucket 2", waited)]),
        NAMES[1]: _report(tensors=16),
        NAMES[2]: _report(tensors=0, waiting=[("rollout rank 0", "waiting for bucket 0",
                                               waited)]),
        NAMES[3]: _report(tensors=0, waiting=[("rollout rank 1", "waiting for bucket 0",
                                               waited + 1)]),
    }
    culprits = stalled_processes(reports, NAMES)
    assert culprits[0].name == NAMES[1]
    assert NAMES[2] in culprits[0].verdict and "network between their hosts" in culprits[0].verdict


MANAGER_SETTINGS = {"backend": "gloo", "rollout_dtype": "bfloat16", "verify": True,
                    "update_weights_bucket_megabytes": 64,
                    "engine_kwargs['gloo']['senders']": 2}


def test_the_first_process_built_with_other_settings_is_named_with_both_values() -> None:
    fp32 = {**MANAGER_SETTINGS, "rollout_dtype": "float32"}
    found = settings_mismatch(MANAGER_SETTINGS, [MANAGER_SETTINGS, MANAGER_SETTINGS, fp32,
                                                 MANAGER_SETTINGS], NAMES)
    assert found == (
        "rollout rank 1 (replica 1, worker 0)",
        "was built with rollout_dtype='float32' but this manager's config says 'bfloat16': "
        "build every process's engine from the manager's config",
    )
    relay = {**MANAGER_SETTINGS, "engine_kwargs['gloo']['senders']": 1, "verify": False}
    name, what = settings_mismatch(MANAGER_SETTINGS, [relay, MANAGER_SETTINGS, relay, relay],
                                   NAMES) or ("", "")
    assert name == "actor_wg rank 0"
    assert what == (
        "was built with verify=False, engine_kwargs['gloo']['senders']=1 but this manager's "
        "config says verify=True, engine_kwargs['gloo']['senders']=2: build every process's "
        "engine from the manager's config (2 other process(es) differ as well: rollout rank 1 "
        "(replica 1, worker 0), rollout rank 2 (replica 2, worker 0))"
    )


def test_settings_agree_where_equal_and_processes_that_cannot_say_are_not_compared() -> None:
    assert settings_mismatch(MANAGER_SETTINGS, [dict(MANAGER_SETTINGS)] * 4, NAMES) is None
    # a worker that does not answer (verl's own), or an older one that names fewer settings
    older = {key: MANAGER_SETTINGS[key] for key in ("backend", "rollout_dtype")}
    assert settings_mismatch(MANAGER_SETTINGS, [None, older, "?", MANAGER_SETTINGS],
                             NAMES) is None


def test_another_backend_is_named_alone() -> None:
    nixl = {"backend": "nixl", "rollout_dtype": None, "verify": True,
            "update_weights_bucket_megabytes": 64, "engine_kwargs['nixl']['slots']": 2}
    found = settings_mismatch(MANAGER_SETTINGS, [MANAGER_SETTINGS, nixl, MANAGER_SETTINGS,
                                                 MANAGER_SETTINGS], NAMES)
    assert found is not None
    assert found[1].startswith("was built with backend='nixl' but this manager's config says "
                               "'gloo': ")


def test_engine_names_of_peers_translate_through_a_round_s_mapping() -> None:
    """A round of a mixed delta sync numbers its workers from 0: its engines' ``rollout rank
    0`` is the manager's ``rollout rank 2 (replica 2, worker 0)``."""
    peers = {"actor rank 0": "actor_wg rank 0",
             "rollout rank 0": "rollout rank 2 (replica 2, worker 0)"}
    progress = {
        "actor_wg rank 0": _report("sending", waiting=[("rollout rank 0", "writing", 9.0)]),
        "rollout rank 2 (replica 2, worker 0)": _report(
            waiting=[("actor rank 0", "reading", 9.0)]),
    }
    [culprit] = stalled_processes(progress, NAMES, peers)
    assert culprit.name == "actor_wg rank 0"
    assert "it and rollout rank 2 (replica 2, worker 0) have waited" in culprit.verdict
