"""The contract between capture (the proxy's TITO log) and training: one record per model call.

A ``TitoRecord`` holds exactly the token ids the model saw and produced, and the behaviour
log-probs of the produced ones; of a mixture-of-experts model also the experts each position was
routed to (``routes``), so training can send every token through the experts that sampled it.
An ``EncodedRecord`` is the same call as stored on disk: its input is not repeated but expressed
against an earlier record of the same run, so a run that re-sends a growing context 800 times
stores each token once (and its routes once).
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


def as_routes(values: Any, experts: int) -> np.ndarray:
    """Routed experts [positions, layers, top-k] as a read-only array of the narrowest type that
    holds ``experts`` ids: one byte an id up to 256 experts, two beyond. An id outside
    [0, experts) is refused (a trainer replaying it would fail)."""
    wide = np.asarray(values, dtype=np.int64)
    if wide.ndim != 3:
        raise ValueError(f"routes must be [positions, layers, top-k], not {wide.shape}")
    if wide.size and (wide.min() < 0 or wide.max() >= experts):
        raise ValueError(f"routes hold expert ids outside [0, {experts})")
    arr = wide.astype(np.uint8 if experts <= 256 else np.uint16)
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
    routes: np.ndarray | None = None
    """[positions, layers, top-k]: the experts the engine routed positions ``routes_from`` on of
    input + output to (the last output position is never forwarded, so has none); None for a
    dense model, or when not asked for."""
    routes_from: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", as_ids(self.input_ids))
        object.__setattr__(self, "output_ids", as_ids(self.output_ids))
        object.__setattr__(self, "output_logprobs", as_logprobs(self.output_logprobs))
        n_ids, n_lp = len(self.output_ids), len(self.output_logprobs)
        if n_ids != n_lp:
            raise ValueError(f"call {self.call_id}: {n_ids} output ids but {n_lp} log-probs")
        _check_routes(self.call_id, self.routes, self.routes_from, len(self.input_ids) + n_ids)

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
    routes: np.ndarray | None = None
    """As ``TitoRecord.routes``: positions ``routes_from`` on of its sequence."""
    routes_from: int = 0

    def __post_init__(self) -> None:
        _check_routes(self.call_id, self.routes, self.routes_from, self.input_len + len(self.output_ids))

    @property
    def input_len(self) -> int:
        return self.shared + len(self.new_ids)


def _check_routes(call_id: str, routes: np.ndarray | None, start: int, length: int) -> None:
    if routes is not None and not (routes.ndim == 3 and 0 <= start and start + len(routes) <= length):
        raise ValueError(f"call {call_id}: routes {routes.shape} from {start} do not fit {length} positions")
