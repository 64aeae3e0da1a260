"""The entry object of one experiment: builds the trainer, injects per-role context, runs."""

from __future__ import annotations

from typing import Any

from weightsync_trainer.config import ExperimentConfig
from weightsync_trainer.trainer import RayPPOTrainer, StepCallback

__all__ = ["TaskRunner", "run_and_shut_down"]


class TaskRunner:
    """Builds a :class:`RayPPOTrainer` and runs it.

    Hooks for subclasses: :meth:`extra_context` returns the ``extra_context`` of each
    training role (``"actor"``, ``"critic"``); it is set on the trainer as
    ``_actor_extra_context`` / ``_critic_extra_context`` and reaches the worker processes in
    their ``TrainingWorkerConfig``. ``trainer_cls`` selects the trainer class.

    Example::

        class MyRunner(TaskRunner):
            def extra_context(self, role):
                return {"reward_scale": 2.0} if role == "critic" else {}
    """

    trainer_cls: type[RayPPOTrainer] = RayPPOTrainer

    def __init__(self, config: ExperimentConfig) -> None:
        self.config = config
        self.trainer: RayPPOTrainer | None = None

    def extra_context(self, role: str) -> dict[str, Any]:
        """Context for the workers of ``role``; empty by default."""
        return {}

    def build_trainer(self) -> RayPPOTrainer:
        """The trainer, with each role's context injected."""
        trainer = self.trainer_cls(self.config)
        for role in ("actor", "critic"):
            context = self.extra_context(role)
            if context:
                setattr(trainer, f"_{role}_extra_context", context)
        return trainer

    def run(self, on_step: StepCallback | None = None) -> list[dict[str, float]]:
        """Build the trainer (kept in :attr:`trainer`) and train; returns per-step metrics."""
        self.trainer = self.build_trainer()
        return self.trainer.run(on_step)


def run_and_shut_down(config: ExperimentConfig) -> list[dict[str, float]]:
    """Run the experiment ``config`` describes to its end and stop every worker it started
    (also when it fails); its per-step metrics (the benchmarks' runs)."""
    runner = TaskRunner(config)
    try:
        return runner.run()
    finally:
        if runner.trainer is not None:
            runner.trainer.shutdown()
