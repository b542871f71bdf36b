"""The contract between capture (the proxy's TITO log) and training: one record per model call.

A ``TitoRecord`` holds exactly the token ids the model saw and produced, and the behaviour
log-probs of the produced ones. An ``EncodedRecord`` is the same call as stored on disk: its
input is not repeated but expressed against an earlier record of the same run, so a run that
re-sends a growing context 800 times stores each token once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

MAIN, MAIN_SUMMARY, SUB_AGENT, SUB_AGENT_SUMMARY = "main", "main-summary", "sub-agent", "sub-agent-summary"
ROLE_PRIORITY = (MAIN, MAIN_SUMMARY, SUB_AGENT, SUB_AGENT_SUMMARY)


def as_ids(values: Any) -> np.ndarray:
    """Token ids as a read-only int32 array."""
    arr = np.array(values, dtype=np.int32).reshape(-1)
    arr.flags.writeable = False
    return arr


def as_logprobs(values: Any) -> np.ndarray:
    arr = np.array(values, dtype=np.float32).reshape(-1)
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, eq=False)
class CallMeta:
    """Where and when a call ran; carried through unchanged."""

    policy_version: int = 0
    engine: str = ""
    cell: int = -1
    t_start: float = 0.0
    t_end: float = 0.0
    rerouted: bool = False
    aborted: bool = False
    finish_reason: str = ""
    segments: tuple[tuple[int, int], ...] = ()
    """(output tokens, version) of each part of a call that spanned a load, in order; empty when
    one version (``policy_version``) generated the whole output."""
    cached_tokens: int = 0
    """Input tokens the engine took from its prefix cache (keys and values of its own version)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple((int(n), int(v)) for n, v in self.segments))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def stored(self) -> dict[str, Any]:
        """What the TITO log keeps: the fields not at their defaults (a reader fills those in),
        so a field added later costs the calls that do not use it nothing."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) != f.default}

    def versions(self) -> list[tuple[int, int]]:
        """(output tokens, version) of every part; one part at ``policy_version`` when unsplit."""
        return list(self.segments) or [(-1, self.policy_version)]

    def output_versions(self, n: int) -> np.ndarray:
        """The version that generated each of the call's ``n`` output tokens."""
        if not self.segments:
            return np.full(n, self.policy_version, dtype=np.int32)
        out = np.repeat([v for _, v in self.segments], [k for k, _ in self.segments]).astype(np.int32)
        if len(out) != n:
            raise ValueError(f"segments cover {len(out)} output tokens, the call has {n}")
        return out


@dataclass(frozen=True, eq=False)
class TitoRecord:
    """One model call: exact input ids, output ids and behaviour log-probs (one per output id)."""

    run_id: str
    call_id: str
    role: str
    input_ids: np.ndarray
    output_ids: np.ndarray
    output_logprobs: np.ndarray
    meta: CallMeta = field(default_factory=CallMeta)

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", as_ids(self.input_ids))
        object.__setattr__(self, "output_ids", as_ids(self.output_ids))
        object.__setattr__(self, "output_logprobs", as_logprobs(self.output_logprobs))
        n_ids, n_lp = len(self.output_ids), len(self.output_logprobs)
        if n_ids != n_lp:
            raise ValueError(f"call {self.call_id}: {n_ids} output ids but {n_lp} log-probs")

    @property
    def policy_version(self) -> int:
        return self.meta.policy_version

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TitoRecord):
            return NotImplemented
        return (
            (self.run_id, self.call_id, self.role, self.meta.to_dict())
            == (other.run_id, other.call_id, other.role, other.meta.to_dict())
            and np.array_equal(self.input_ids, other.input_ids)
            and np.array_equal(self.output_ids, other.output_ids)
            and np.array_equal(self.output_logprobs, other.output_logprobs)
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, eq=False)
class EncodedRecord:
    """A record as stored: ``input = sequence(ref)[:shared] + new_ids``.

    ``sequence(r)`` is record r's input followed by its output; ``ref`` is the index of an
    earlier record of the same run (-1 with ``shared == 0`` when nothing is shared).
    """

    run_id: str
    index: int
    call_id: str
    role: str
    ref: int
    shared: int
    new_ids: np.ndarray
    output_ids: np.ndarray
    output_logprobs: np.ndarray
    meta: CallMeta = field(default_factory=CallMeta)

    @property
    def input_len(self) -> int:
        return self.shared + len(self.new_ids)
