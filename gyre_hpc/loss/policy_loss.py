"""The policy-gradient loss: PPO clip against the TITO behaviour log-probs, dual clip, and
truncated importance sampling of the trainer/engine mismatch; per-token weighted.

```
 token sampled at an older version (stale)    −max(min(r·A, clip(r)·A), …)  r = π/μ, dual clip if A < 0
 token sampled at the trained version, tis    −min(π/μ, C)ᵍ · π/πᵍ · A      (ᵍ: no gradient)
```

The core takes one optimizer step per batch, so the proximal policy of a decoupled objective is
the weights being trained: for a token sampled at that version the gap between π and μ is the
engine's numerics alone, corrected by a truncated importance weight, and its ratio to the
proximal policy is 1 (no clip can bind). A stale token's gap mixes staleness with numerics,
which cannot be told apart without the trainer's log-prob at the version that sampled it (not
kept): it stays under the clip against μ.

``weighted_policy_loss`` returns a *sum* over tokens of ``weight * loss``; the trainer adds
those sums over micro-steps and divides once by R (see ``trajectory.batch``), which makes the
result independent of how the batch was split. Pure torch: it knows nothing of models or trainers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Surrogate:
    """The loss's rule: ``trainer.clip_low``, ``clip_high``, ``dual_clip``, ``mismatch_correction``,
    ``mismatch_cap``."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 3.0
    mismatch_correction: str = "none"
    mismatch_cap: float = 2.0

    @classmethod
    def of(cls, trainer: Any) -> Surrogate:
        """From a ``TrainerConfig``."""
        return cls(trainer.clip_low, trainer.clip_high, trainer.dual_clip, trainer.mismatch_correction,
                   trainer.mismatch_cap)  # fmt: skip


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
    dual_clip: float = 0.0,
) -> torch.Tensor:
    """Per-token clipped surrogate, to be minimised: −min(r·A, clip(r, 1−low, 1+high)·A); with
    ``dual_clip`` c > 1, a token of negative advantage loses at most c·|A|."""
    ratio = torch.exp(logprobs - behaviour)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    if dual_clip:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    return loss


def policy_loss(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    rule: Surrogate,
    fresh: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token loss under ``rule``; ``fresh`` marks the tokens sampled at the version trained
    (None: not known, every token is treated as stale)."""
    loss = ppo_clip_loss(logprobs, behaviour, advantages, rule.clip_low, rule.clip_high, rule.dual_clip)
    if rule.mismatch_correction == "tis" and fresh is not None:
        weight = torch.clamp(torch.exp(logprobs.detach() - behaviour), max=rule.mismatch_cap)
        on_policy = torch.exp(logprobs - logprobs.detach())  # 1, with the gradient of log π
        loss = torch.where(fresh, -weight * on_policy * advantages, loss)
    return loss


def weighted_policy_loss(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    rule: Surrogate,
    fresh: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ weight·loss over masked tokens (all arguments shaped like ``logprobs``)."""
    per_token = policy_loss(logprobs, behaviour, advantages, rule, fresh)
    return (per_token * weights * mask).sum()
