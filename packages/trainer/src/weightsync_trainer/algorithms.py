"""Advantage estimators and losses of GRPO and PPO (pure tensor functions).

Responses have a fixed length (no EOS), so every response token counts and no masks are
needed.
"""

from __future__ import annotations

import torch

__all__ = [
    "gae_advantages",
    "grpo_advantages",
    "importance_weights",
    "policy_loss",
    "value_loss",
    "whiten",
]

_EPS = 1e-6


def grpo_advantages(rewards: torch.Tensor, group_size: int, response_length: int) -> torch.Tensor:
    """GRPO: each response's reward relative to its group (same prompt), divided by the
    group's standard deviation; broadcast to every token. ``rewards`` is ``[batch]`` ordered
    group by group; returns ``[batch, response_length]``."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    advantages = ((groups - mean) / (std + _EPS)).view(-1)
    return advantages.unsqueeze(1).expand(-1, response_length).contiguous()


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens.

    Args:
        rewards: ``[batch, T]`` per-token rewards (the sequence reward sits on the last token).
        values: ``[batch, T]`` critic values of the state before each token.

    Returns:
        ``(advantages, returns)``, both ``[batch, T]``; ``returns = advantages + values``.
    """
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    length = rewards.shape[1]
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    return advantages, advantages + values


def whiten(values: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit variance over the whole batch."""
    return (values - values.mean()) / (values.std() + _EPS)


def policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
    clip_ratio: float, weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate (token mean); returns ``(loss, fraction of clipped tokens)``.
    ``weights``: per-token weights of the surrogate (decoupled PPO's importance weights of
    the actor before the update against the weights that sampled each token; see
    :func:`importance_weights`)."""
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    surrogate = torch.maximum(unclipped, clipped)
    loss = (surrogate if weights is None else surrogate * weights).mean()
    clip_fraction = (clipped > unclipped).float().mean()
    return loss, clip_fraction


def importance_weights(
    proximal_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Per-token ``min(pi_prox / pi_behav, threshold)``: how much likelier the actor before
    this update makes each token than the (possibly older) weights that sampled it did,
    truncated (no gradient)."""
    return torch.exp(proximal_log_probs - behaviour_log_probs).clamp(max=threshold).detach()


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> torch.Tensor:
    """PPO's clipped value loss (token mean)."""
    clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2).mean()
