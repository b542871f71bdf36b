"""Sampling parameters as SGLang's ``/generate`` takes them, and sampling with exact log-probs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch


class BadRequest(ValueError):
    """A request that does not fit the API (HTTP 400)."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @classmethod
    def from_request(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Known keys are type-checked; unknown keys are ignored, as SGLang does."""
        d = dict(d or {})
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d or d[f.name] is None:
                continue
            v = d[f.name]
            ok = {
                "max_new_tokens": isinstance(v, int) and v >= 0,
                "temperature": _num(v) and v >= 0,
                "top_p": _num(v) and 0 < v <= 1,
                "top_k": isinstance(v, int) and (v == -1 or v >= 1),
                "min_p": _num(v) and 0 <= v <= 1,
                "stop": isinstance(v, list) and all(isinstance(s, str) for s in v),
                "stop_token_ids": isinstance(v, list) and all(isinstance(i, int) for i in v),
                "ignore_eos": isinstance(v, bool),
                "n": isinstance(v, int) and v >= 1,
                "sampling_seed": isinstance(v, int),
            }[f.name]
            if not ok:
                raise BadRequest(f"sampling_params.{f.name} = {v!r} is not valid")
            values[f.name] = v
        return cls(**values)


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """One token from ``logits`` [vocab] and its log-prob under the distribution sampled from.

    Temperature, top-k, top-p and min-p shape that distribution; greedy (temperature 0) reports
    the log-prob under the unscaled softmax.
    """
    logits = logits.float()
    if p.temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, -1)[token])
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, 0) - sorted_p > p.top_p
        probs = probs.clone()
        probs[order[drop]] = 0
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0)
    probs = probs / probs.sum()
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(torch.log(probs[token]))
