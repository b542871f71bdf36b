"""What one execution ended as: the harness's record and the score it got, a frozen contract.

```
 Outcome ─┬─ Execution    what the harness did: status, calls, tokens, tool calls, seconds
          └─ ScoreResult  what the scoring rules made of it: kind, reward, attempts, why
```

These are values only, beneath the harnesses that fill in an ``Execution``, the scoring rules
that make a ``ScoreResult`` and everything that reads an ``Outcome`` (the journal, the executor
hub, the step kinds, batching, the simulator). It knows nothing of how an execution runs or how
it is scored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Kind = Literal["scored", "partial", "placeholder", "dropped"]


@dataclass(kw_only=True)
class Execution:
    run_id: str
    task_id: str
    workspace: Path
    status: str = "running"  # finished | timed_out | stopped | crashed
    calls: int = 0
    calls_by_role: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    """Context processed: input + output tokens summed over every model call."""
    compactions: int = 0
    sub_agents: int = 0
    tool_errors: int = 0
    tool_calls: int = 0
    """Tool calls the built-in harness carried out (a black-box harness's are not seen)."""
    summary: str = ""
    error: str = ""
    seconds: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ScoreResult:
    run_id: str
    kind: Kind
    reward: float | None
    attempts: int
    reason: str = ""

    @property
    def counts_in_group(self) -> bool:
        """Dropped runs have no reward; every other run takes part in its group's statistics."""
        return self.kind != "dropped"

    @property
    def trainable(self) -> bool:
        """Only runs with a real evaluation contribute tokens."""
        return self.kind in ("scored", "partial")


@dataclass(kw_only=True)
class Outcome:
    execution: Execution
    score: ScoreResult

    def to_json(self) -> dict[str, Any]:
        return {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.execution).items()},
            "score": asdict(self.score),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Outcome:
        fields = {k: v for k, v in data.items() if k != "score"}
        return cls(
            execution=Execution(**{**fields, "workspace": Path(fields["workspace"])}),
            score=ScoreResult(**data["score"]),
        )


PASS = 1.0
"""The reward of an execution that passes: full credit, nothing partial."""


def group_rewards(outcomes: Iterable[Outcome]) -> list[float]:
    """The rewards of the outcomes that count in their group (a dropped run has none)."""
    return [o.score.reward or 0.0 for o in outcomes if o.score.counts_in_group]


def pass_rate(rewards: Sequence[float]) -> float:
    """The share of ``rewards`` that pass; 0 for none."""
    return sum(r >= PASS for r in rewards) / max(len(rewards), 1)


def mean_reward(rewards: Sequence[float]) -> float:
    """Their mean; 0 for none."""
    return sum(rewards) / max(len(rewards), 1)
