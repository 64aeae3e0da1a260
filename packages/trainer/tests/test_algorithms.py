"""Advantage estimators, losses and the synthetic task's reward."""

import pytest
import torch

from weightsync_trainer.algorithms import (
    gae_advantages,
    grpo_advantages,
    policy_loss,
    value_loss,
    whiten,
)
from weightsync_trainer.config import DataConfig, ModelConfig, TaskConfig
from weightsync_trainer.task import TargetTokenTask


def test_grpo_advantages_are_relative_to_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.4])
    adv = grpo_advantages(rewards, group_size=2, response_length=3)
    assert adv.shape == (6, 3)
    std = torch.tensor([1.0, 0.0]).std()
    assert adv[0, 0] == pytest.approx(0.5 / (std.item() + 1e-6))
    assert adv[1].tolist() == pytest.approx([-0.5 / (std.item() + 1e-6)] * 3)
    assert adv[2:4].abs().max() == 0  # identical rewards: no signal
    with pytest.raises(ValueError, match="groups of 4"):
        grpo_advantages(rewards, group_size=4, response_length=1)


def test_gae_matches_a_hand_computation():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 0.6]])
    gamma, lam = 0.9, 0.8
    d2 = 1.0 - 0.6
    d1 = 0.0 + gamma * 0.6 - 0.4
    d0 = 0.0 + gamma * 0.4 - 0.2
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    adv, returns = gae_advantages(rewards, values, gamma, lam)
    assert adv[0].tolist() == pytest.approx([a0, a1, a2])
    assert returns[0].tolist() == pytest.approx([a0 + 0.2, a1 + 0.4, a2 + 0.6])


def test_policy_loss_clips_large_ratios():
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.5, -0.5]])  # ratios e^0.5, e^-0.5: both outside 1 +- 0.2
    adv = torch.ones(1, 2)
    loss, clipped = policy_loss(new, old, adv, clip_ratio=0.2)
    expected = -(1.2 + torch.exp(torch.tensor(-0.5)).item()) / 2
    assert loss.item() == pytest.approx(expected)
    assert clipped.item() == pytest.approx(0.5)


def test_value_loss_and_whiten():
    values = torch.tensor([[2.0]])
    loss = value_loss(values, old_values=torch.zeros(1, 1), returns=torch.zeros(1, 1),
                      value_clip=0.5)
    assert loss.item() == pytest.approx(0.5 * 4.0)
    white = whiten(torch.tensor([1.0, 2.0, 3.0]))
    assert white.mean().abs() < 1e-6 and white.std().item() == pytest.approx(1.0, abs=1e-5)


def test_task_reward_counts_target_tokens():
    task = TargetTokenTask(TaskConfig(target_token=3), ModelConfig(),
                           DataConfig(max_prompt_length=4, max_response_length=4))
    responses = torch.tensor([[3, 3, 3, 3], [3, 0, 1, 3], [0, 1, 2, 4]])
    assert task.reward(responses).tolist() == [1.0, 0.5, 0.0]
    prompts = task.sample_prompts(5, torch.Generator().manual_seed(0))
    assert prompts.shape == (5, 4) and prompts.max() < 16
