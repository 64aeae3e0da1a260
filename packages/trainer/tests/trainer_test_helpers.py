"""Shared helpers of the trainer tests."""

import torch

from weightsync_trainer import TaskRunner, load_config
from weightsync_trainer.config import ModelConfig
from weightsync_trainer.modeling import build_policy_model


def run_experiment(overrides):
    """Run one experiment (defaults plus ``overrides``); returns ``(runner, per-step
    metrics)``. The caller shuts the trainer down."""
    runner = TaskRunner(load_config(overrides=overrides))
    return runner, runner.run()


def mean_reward(rows):
    """Mean of ``reward/mean`` over ``rows``."""
    return sum(row["reward/mean"] for row in rows) / len(rows)


def hf_sampled_tokens(model: ModelConfig, state: dict[str, torch.Tensor], prompt: torch.Tensor,
                      seed: int, length: int) -> torch.Tensor:
    """The ``length`` tokens Hugging Face samples (temperature 1, seed ``seed``) after
    ``prompt`` with ``model``'s weights ``state``, in bf16 as the replicas serve them."""
    reference = build_policy_model(model).eval().to(torch.bfloat16)
    reference.load_state_dict({name: tensor.to(torch.bfloat16) for name, tensor in state.items()})
    torch.manual_seed(seed)
    with torch.no_grad():
        out = reference.generate(  # pyright: ignore[reportCallIssue]
            prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0,
            top_k=0, top_p=1.0, max_new_tokens=length, use_cache=True, pad_token_id=0)
    return out[:, prompt.shape[1]:]
