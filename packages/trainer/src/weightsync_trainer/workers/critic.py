"""The critic rank: a value model trained with PPO's clipped value loss."""

from __future__ import annotations

import torch

from weightsync_trainer.algorithms import value_loss
from weightsync_trainer.modeling import build_value_model
from weightsync_trainer.workers.training import TrainingWorker

__all__ = ["CriticWorker"]


class CriticWorker(TrainingWorker):
    """Values ``V(s_t)`` of the state before each response token, and their update."""

    role = "critic"
    model_type = "value_model"

    def build_model(self) -> torch.nn.Module:
        return build_value_model(self.config.model)

    def _values(self, input_ids: torch.Tensor, response_length: int) -> torch.Tensor:
        scores = self._built_model()(input_ids=input_ids).logits[..., 0].float()
        return scores[:, -response_length - 1 : -1]

    def compute_values(self, input_ids: torch.Tensor, response_length: int) -> torch.Tensor:
        """``[batch, response_length]`` values for this rank's shard (collective)."""
        self._built_model().eval()
        with torch.no_grad():
            return self._values(input_ids, response_length)

    def update_critic(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Fit values to ``batch["returns"]`` (clipped around ``batch["values"]``)."""
        input_ids, returns, old_values = batch["input_ids"], batch["returns"], batch["values"]
        length = returns.shape[1]

        def loss_fn(rows: slice):
            values = self._values(input_ids[rows], length)
            loss = value_loss(
                values, old_values[rows], returns[rows], self.config.cliprange_value
            )
            return loss, {"critic/value_loss": loss.detach()}

        return self._optimize(loss_fn, input_ids.shape[0])
