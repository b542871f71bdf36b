"""The policy-gradient loss: PPO clip against the TITO behaviour log-probs, per-token weighted.

``weighted_policy_loss`` returns a *sum* over tokens of ``weight * loss``; the trainer adds
those sums over micro-steps and divides once by R (see ``trajectory.batch``), which makes the
result independent of how the batch was split.
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of ``tokens[..., 1:]`` under ``logits[..., :-1, :]``; position 0 gets 0."""
    logp = torch.log_softmax(logits[..., :-1, :].float(), dim=-1)
    picked = logp.gather(-1, tokens[..., 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def ppo_clip_loss(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> torch.Tensor:
    """Per-token clipped surrogate, to be minimised: −min(r·A, clip(r, 1−low, 1+high)·A)."""
    ratio = torch.exp(logprobs - behaviour)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def weighted_policy_loss(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> torch.Tensor:
    """Σ weight·loss over masked tokens (all arguments shaped like ``logprobs``)."""
    per_token = ppo_clip_loss(logprobs, behaviour, advantages, clip_low, clip_high)
    return (per_token * weights * mask).sum()
