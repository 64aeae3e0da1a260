"""The synthetic task: a tiny random model learns it in a few dozen steps.

Prompts are random token sequences; the reward of a response is the fraction of its tokens
equal to ``target_token``. A random policy scores about ``1 / vocab_size``; a policy that
learned the task scores near 1, so a rising reward shows that the rollout replicas generate
with the weights the actor trained.
"""

from __future__ import annotations

import torch

from weightsync_trainer.config import DataConfig, ModelConfig, TaskConfig

__all__ = ["TargetTokenTask"]


class TargetTokenTask:
    """Prompts and rewards of the target-token task."""

    def __init__(self, task: TaskConfig, model: ModelConfig, data: DataConfig) -> None:
        self.config = task
        self.vocab_size = model.vocab_size
        self.prompt_length = data.max_prompt_length

    def sample_prompts(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """``count`` random prompts, ``[count, data.max_prompt_length]`` token ids."""
        return torch.randint(
            0, self.vocab_size, (count, self.prompt_length), generator=generator
        )

    def reward(self, responses: torch.Tensor) -> torch.Tensor:
        """Per-response reward in [0, 1] for ``[batch, response_length]`` token ids."""
        return (responses == self.config.target_token).float().mean(dim=-1)
