"""A worker's engine calls wait for an abort of its engine still running: the abort of an
engine written for verl replaces it with a new one at its end, and the next sync's session
key, set meanwhile on the old one, was lost ("has no session key" at init_process_group)."""

from __future__ import annotations

import asyncio

from weightsync_core import CheckpointEngineConfig, CheckpointEngineWorker, new_session_key
from weightsync_core.worker import rollout
from weightsync_core.worker.lifecycle import build_engine

CONFIG = CheckpointEngineConfig(backend="naive")


def test_a_session_key_set_while_the_engine_is_aborted_reaches_the_engine_that_follows(
        monkeypatch):
    async def slow_replacing_abort(engine, config):  # as for an engine written for verl
        await asyncio.sleep(0.2)  # its finalize, on a blocking thread
        return build_engine(config)

    monkeypatch.setattr(rollout, "engine_after_abort", slow_replacing_abort)
    worker = CheckpointEngineWorker(CONFIG)
    key = new_session_key()

    async def abort_then_next_sync() -> None:
        abort = asyncio.ensure_future(worker.execute_checkpoint_engine("abort"))
        await asyncio.sleep(0.05)  # the next sync's first call arrives during the abort
        await worker.execute_checkpoint_engine("set_session_key", key=key)
        await abort

    asyncio.run(abort_then_next_sync())
    assert worker.checkpoint_engine._session_key == key
