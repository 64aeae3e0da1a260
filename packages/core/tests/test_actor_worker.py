"""An actor worker (``ActorCheckpointEngineMixin``) used before ``init_checkpoint_engine()``
says so in words, whatever it set itself."""

import asyncio

import pytest
import torch

from weightsync_core import ActorCheckpointEngineMixin, CheckpointEngineConfig, WeightSyncError
from weightsync_core.worker import build_engine


class _Actor(ActorCheckpointEngineMixin):
    """Never calls ``init_checkpoint_engine()``."""

    def iter_weights(self):
        return iter([("w", torch.zeros(2))])


class _EngineBuiltByHand(_Actor):
    """Builds its engine itself, as a worker written before ``init_checkpoint_engine()``."""

    def __init__(self) -> None:
        self.checkpoint_engine = build_engine(CheckpointEngineConfig(backend="naive"))


@pytest.mark.parametrize("actor_class", [_Actor, _EngineBuiltByHand])
@pytest.mark.parametrize("method", ["update_weights", "execute_checkpoint_engine"])
def test_an_actor_worker_used_before_init_checkpoint_engine_says_to_call_it(actor_class, method):
    actor = actor_class()
    call = (actor.update_weights(global_steps=1) if method == "update_weights"
            else actor.execute_checkpoint_engine("prepare"))
    with pytest.raises(WeightSyncError, match=(
            rf"{actor_class.__name__}\.{method}\(\) needs this actor worker's checkpoint engine, "
            r"but init_checkpoint_engine\(\) has not run on it \(it has no .*delta_sender\): "
            r"call self\.init_checkpoint_engine\(config\)")):
        asyncio.run(call)
