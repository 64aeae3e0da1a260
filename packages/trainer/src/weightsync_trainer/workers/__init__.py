"""Ray worker classes: the actor (FSDP2 policy), the critic (value model) and the rollout."""

from weightsync_trainer.workers.actor import ActorWorker
from weightsync_trainer.workers.critic import CriticWorker
from weightsync_trainer.workers.generation import HFGenerationServer
from weightsync_trainer.workers.rollout import RolloutWorker
from weightsync_trainer.workers.training import TrainingWorker

__all__ = ["ActorWorker", "CriticWorker", "HFGenerationServer", "RolloutWorker", "TrainingWorker"]
