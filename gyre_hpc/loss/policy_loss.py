"""The policy-gradient loss: an objective against an anchor log-prob, a correction of the
trainer/engine mismatch, per-token weighted.

```
 loss token t of path p:   weight_t · c_t · objective(log π_t, anchor_t, A)
   anchor_t = log μ_t (behaviour)            a stale token, or any token with correction none
            = log π_t, no gradient (proximal) a token sampled at the version trained, corrected
   c_t      = 1 | min(π/μ, C) (tis) | π/μ inside [low, C], else rejected (mis, icepop)
            | min(Π_p π/μ, C) (sequence-tis) | Π_p π/μ inside [low, C], else rejected (sequence-mis)
            | 1, rejected if (Π_p π/μ)^(1/n) ∉ [low, C] (geometric-mask)
 objective: ppo  −min(r·A, clip(r)·A), dual clip if A < 0           r = π/anchor
            gspo the same with r = exp(mean_p log π/anchor), one ratio for the whole path
            cispo −clip(r)ᵍ·A·log π   (ᵍ: no gradient)
            module:function, called as f(logprobs, anchor, advantages, segments, rule)
```

The core takes one optimizer step per batch, so the proximal policy of a decoupled objective is
the weights being trained: for a token sampled at that version the gap between π and μ is the
engine's numerics alone, corrected by the importance weight c_t, and its ratio to the proximal
policy is 1 (no clip can bind). A stale token's gap mixes staleness with numerics, which cannot be
told apart without the trainer's log-prob at the version that sampled it (not kept): it stays
under the objective against μ, uncorrected. Sequence corrections read a path's fresh tokens only.

A rejected token leaves its path's denominator: the path's kept tokens share the path's weight
(slime #657's bug, rejected tokens counted below the line, cannot occur); a path wholly rejected
trains nothing and keeps its share of its run's denominator, as a run of advantage 0 keeps its
place in its group (a run's paths may lie in different micro-steps: no forward sees them all).

``weighted_policy_loss`` returns a *sum* over tokens of ``weight * loss``; the trainer adds
those sums over micro-steps and divides once (see ``trajectory.sequences``), which makes the
result independent of how the batch was split. Pure torch: it knows nothing of models or trainers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, NamedTuple

import torch

from gyre_hpc.recipe.entry import custom_policy_loss

CORRECTIONS = ("none", "tis", "mis", "sequence-tis", "sequence-mis", "geometric-mask")


@dataclass(frozen=True)
class Surrogate:
    """The loss's rule: ``trainer.policy_loss``, ``clip_low``, ``clip_high``, ``dual_clip``,
    ``mismatch_correction``, ``mismatch_low``, ``mismatch_cap``."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 3.0
    mismatch_correction: str = "none"
    mismatch_cap: float = 2.0
    mismatch_low: float = 0.5
    objective: str = "ppo"

    @classmethod
    def of(cls, trainer: Any) -> Surrogate:
        """From a ``TrainerConfig``."""
        t = trainer
        return cls(t.clip_low, t.clip_high, t.dual_clip, t.mismatch_correction, t.mismatch_cap,
                   t.mismatch_low, t.policy_loss)  # fmt: skip


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
    return _clipped(torch.exp(logprobs - behaviour), advantages, clip_low, clip_high, dual_clip)


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float, dual: float) -> torch.Tensor:
    loss = -torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - low, 1.0 + high) * adv)
    if dual:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual * adv), loss)
    return loss


def segment_sum(values: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Σ of ``values`` per segment id (ids 0..n−1): [n]."""
    n = int(segments.max()) + 1 if segments.numel() else 0
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, segments, values)


def gspo_loss(lp: torch.Tensor, anchor: torch.Tensor, adv: torch.Tensor, segments: torch.Tensor,
              rule: Surrogate) -> torch.Tensor:  # fmt: skip
    """GSPO: each path's tokens share the ratio exp(mean log π/anchor) of the path, clipped as a
    whole; a token's gradient is that ratio times its own ∇log π (GSPO-token's form)."""
    count = segment_sum(torch.ones_like(lp), segments).clamp(min=1)
    mean = segment_sum(lp.detach() - anchor, segments) / count
    ratio = torch.exp(mean[segments] + lp - lp.detach())
    return _clipped(ratio, adv, rule.clip_low, rule.clip_high, rule.dual_clip)


def cispo_loss(lp: torch.Tensor, anchor: torch.Tensor, adv: torch.Tensor, segments: torch.Tensor,
               rule: Surrogate) -> torch.Tensor:  # fmt: skip
    """CISPO: −clip(r)ᵍ·A·∇log π — every token keeps a gradient, its weight is the clipped ratio."""
    ratio = torch.exp(lp.detach() - anchor)
    weight = torch.clamp(ratio, 1.0 - rule.clip_low, 1.0 + rule.clip_high)
    return -weight * adv * torch.exp(lp - lp.detach())


def _ppo(lp: torch.Tensor, anchor: torch.Tensor, adv: torch.Tensor, segments: torch.Tensor,
         rule: Surrogate) -> torch.Tensor:  # fmt: skip
    return ppo_clip_loss(lp, anchor, adv, rule.clip_low, rule.clip_high, rule.dual_clip)


Objective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Surrogate], torch.Tensor]
"""f(logprobs, anchor, advantages, segments, rule) → per-token loss, every tensor [M] over loss
tokens (``segments``: each token's path, 0..paths−1)."""


@cache
def objective(name: str) -> Objective:
    """``trainer.policy_loss`` → its function: a built-in name or an import path
    (``recipe.entry.custom_policy_loss``, which refuses a bad one in one line)."""
    builtin = {"ppo": _ppo, "gspo": gspo_loss, "cispo": cispo_loss}
    return builtin[name] if name in builtin else custom_policy_loss(name)


class Terms(NamedTuple):
    loss: torch.Tensor
    """[M] per-token loss, the correction weight applied (0 where rejected)."""
    rejected: torch.Tensor
    """[M] bool: tokens the mismatch correction left out."""


def mismatch_weights(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    corrected: torch.Tensor,
    segments: torch.Tensor,
    rule: Surrogate,
) -> Terms:
    """Each token's correction weight c_t (no gradient; 1 where not ``corrected``) and which it
    rejects, from the log-prob gaps of the ``corrected`` tokens (those sampled at the version
    trained)."""
    kind, cap, low = rule.mismatch_correction, rule.mismatch_cap, rule.mismatch_low
    gap = torch.where(corrected, logprobs.detach() - behaviour, 0.0)
    none = torch.zeros_like(corrected)
    if kind == "none":
        return Terms(torch.ones_like(gap), none)
    if kind == "tis":
        return Terms(torch.where(corrected, torch.exp(gap).clamp(max=cap), 1.0), none)
    if kind == "mis":
        ratio = torch.exp(gap)
        out = corrected & ((ratio < low) | (ratio > cap))
        return Terms(torch.where(out, 0.0, torch.where(corrected, ratio, 1.0)), out)
    total = segment_sum(gap.double(), segments)
    if kind == "sequence-tis":
        weight = torch.exp(total).clamp(max=cap).to(gap.dtype)
        return Terms(torch.where(corrected, weight[segments], 1.0), none)
    if kind == "sequence-mis":
        ratio = torch.exp(total)
        bad = (ratio < low) | (ratio > cap)
        out = bad[segments] & corrected
        return Terms(torch.where(out, 0.0, torch.where(corrected, ratio.to(gap.dtype)[segments], 1.0)), out)
    if kind == "geometric-mask":
        n = segment_sum(corrected.double(), segments)
        mean = torch.exp(total / n.clamp(min=1))
        bad = (n > 0) & ((mean < low) | (mean > cap))
        out = bad[segments]
        return Terms(torch.where(out, 0.0, 1.0).to(gap.dtype), out)
    raise ValueError(f"mismatch_correction {kind!r}; valid: {', '.join(CORRECTIONS)}")


def policy_terms(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    rule: Surrogate,
    fresh: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> Terms:
    """Per-token loss under ``rule`` over loss tokens [M] (``fresh``: the tokens sampled at the
    version trained, None when not known: every token is treated as stale; ``segments``: each
    token's path, None for one), and the tokens the correction rejected."""
    if segments is None:
        segments = torch.zeros(logprobs.shape, dtype=torch.int64, device=logprobs.device)
    corrected = torch.zeros(logprobs.shape, dtype=torch.bool, device=logprobs.device)
    if fresh is not None and rule.mismatch_correction != "none":
        corrected = fresh
    anchor = torch.where(corrected, logprobs.detach(), behaviour)
    loss = objective(rule.objective)(logprobs, anchor, advantages, segments, rule)
    weight, rejected = mismatch_weights(logprobs, behaviour, corrected, segments, rule)
    return Terms(loss * weight, rejected)


def weighted_policy_loss(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    rule: Surrogate,
    fresh: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> Terms:
    """Σ weight·loss over the tokens where ``mask`` is set (all arguments shaped like
    ``logprobs``; ``segments``: each token's path, None for one), a rejected token's weight
    shared by its path's kept tokens; and the rejected tokens [M] (loss tokens only)."""
    keep = mask > 0
    pick = lambda t: None if t is None else t[keep]  # noqa: E731
    lp, segs = logprobs[keep], pick(segments)
    terms = policy_terms(lp, behaviour[keep], advantages[keep], rule, pick(fresh), segs)
    w = weights[keep]
    if bool(terms.rejected.any()):
        segs = torch.zeros_like(lp, dtype=torch.int64) if segs is None else segs
        kept = (~terms.rejected).to(w.dtype)
        whole, left = segment_sum(w, segs), segment_sum(w * kept, segs)
        w = w * kept * torch.where(left > 0, whole / left.clamp(min=1e-30), 0.0)[segs]
    return Terms((terms.loss * w).sum(), terms.rejected)
