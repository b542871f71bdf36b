"""What a policy update says about its tokens, beside the loss: clipping, KL to the behaviour
policy, entropy, and the trainer/rollout log-prob mismatch, measured here as the sums of a
``token_stats.TokenStats``.

The mismatch is measured only on tokens the trainer forwards at the version that sampled them:
there the two log-probs come from the same weights and should agree to rounding, so a gap is a
broken TITO path, a stale prefix cache, a wrong temperature or a precision bug — not off-policy
data. Pure torch: it knows nothing of models, trainers or steps.
"""

from __future__ import annotations

import torch

from gyre_hpc.loss.token_stats import MISMATCH_AT, TokenStats


@torch.no_grad()
def token_stats(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    matched: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> TokenStats:
    """The sums over the tokens where ``mask`` is set (all arguments shaped like ``logprobs``):
    ``matched`` marks those sampled at the version forwarded now, ``entropy`` gives each token's
    distribution's entropy where the whole vocabulary is at hand."""
    keep = mask > 0
    lp, b = logprobs[keep].double(), behaviour[keep].double()
    ratio = torch.exp(lp - b)
    clipped = int(((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).sum())
    d = b - lp
    kl = float((torch.exp(d) - 1 - d).sum())
    ent_n, ent = 0, 0.0
    if entropy is not None:
        ent_n, ent = int(keep.sum()), float(entropy[keep].double().sum())
    m_n, m_sum, m_max, m_over = 0, 0.0, 0.0, 0
    if matched is not None:
        gap = (lp - b).abs()[matched[keep]]
        m_n = int(gap.numel())
        if m_n:
            m_sum, m_max, m_over = float(gap.sum()), float(gap.max()), int((gap > MISMATCH_AT).sum())
    return TokenStats(int(keep.sum()), clipped, kl, ent_n, ent, m_n, m_sum, m_max, m_over)


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Each row's entropy, in nats, from its log-softmax ([..., V] → [...])."""
    return -(logp.exp() * logp).sum(-1)
