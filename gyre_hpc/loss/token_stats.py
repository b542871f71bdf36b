"""The sums a policy update keeps about its tokens (``loss.diagnostics`` measures them): a value
that micro-steps, cells and data-parallel replicas add (``+``; the largest mismatch takes the
max), sent in a cell's ``TrainDone`` and divided once for the step's event (``summary``).

Plain numbers, beneath the trainers, the scheduler and the loss: it knows nothing of torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MISMATCH_AT = 0.1
"""|Δ log-prob| above which a token counts as mismatched."""


@dataclass(frozen=True, slots=True)
class TokenStats:
    tokens: int = 0
    """Loss tokens."""
    clipped: int = 0
    """Of them, those whose importance ratio was clipped."""
    kl_sum: float = 0.0
    """Σ k3 estimate of KL(behaviour ‖ trainer): exp(b − l) − 1 − (b − l) ≥ 0."""
    entropy_tokens: int = 0
    """Loss tokens whose whole-vocabulary entropy was computed (0 where the logits are sharded)."""
    entropy_sum: float = 0.0
    matched: int = 0
    """Loss tokens forwarded at the version that sampled them."""
    mismatch_sum: float = 0.0
    """Σ |trainer − rollout log-prob| over ``matched``."""
    mismatch_max: float = 0.0
    mismatch_over: int = 0
    """Of ``matched``, those above ``MISMATCH_AT``."""
    masked: int = 0
    """Loss tokens the mismatch correction rejected (``trainer.mismatch_correction`` mis,
    geometric-mask)."""

    def __add__(self, other: TokenStats) -> TokenStats:
        return TokenStats(
            *(
                max(a, b) if f.name == "mismatch_max" else a + b
                for f, a, b in ((f, getattr(self, f.name), getattr(other, f.name)) for f in fields(self))
            )
        )

    def as_list(self) -> list[float]:
        """Every field in order, for a reduction across ranks (``from_list`` reads it back)."""
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_list(cls, values: list[float]) -> TokenStats:
        kinds = [f.type for f in fields(cls)]
        return cls(*(int(v) if k in (int, "int") else float(v) for v, k in zip(values, kinds, strict=True)))

    def summary(self) -> dict[str, float | None]:
        """The step's per-token figures (None where nothing was measured)."""

        def mean(total: float, n: int) -> float | None:
            return round(total / n, 6) if n else None

        return {
            "clip_fraction": mean(self.clipped, self.tokens),
            "approx_kl": mean(self.kl_sum, self.tokens),
            "entropy": mean(self.entropy_sum, self.entropy_tokens),
            "mismatch_mean": mean(self.mismatch_sum, self.matched),
            "mismatch_max": round(self.mismatch_max, 6) if self.matched else None,
            "mismatch_share": mean(self.mismatch_over, self.matched),
            "mismatch_tokens": self.matched,
            "mask_fraction": mean(self.masked, self.tokens),
        }
