"""A task checked against itself, in the sandbox: its reference solution should earn 1.0 and an
empty attempt 0 (``gyre-hpc tasks verify``); and a workspace scored or seeded as a run would
(``gyre-hpc sandbox score|exec``).

```
 task ─▶ fresh workspace (its files, its setup) ─┬─ reference applied ─▶ scored: expect 1.0
                                                 └─ as it is ──────────▶ scored: expect 0
```

A task whose reference does not earn 1.0, or whose empty attempt earns more than 0, would teach
the policy nothing true. Scoring here is the run's (``scoring``, a copy, the scoring sandbox).
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.agents import reference
from gyre_hpc.agents.dispatch import setup
from gyre_hpc.execution.outcome import ScoreResult
from gyre_hpc.sandbox.confine import Sandbox
from gyre_hpc.scoring import RunArtifacts, ScoringRunners
from gyre_hpc.tasks.task import Task


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What a task's reference and its empty attempt earned (None: not scored, ``why``)."""

    reference: float | None
    reference_why: str
    empty: float | None
    empty_why: str

    @property
    def good(self) -> bool:
        """The reference earns 1.0 (or the task has none) and the empty attempt earns 0."""
        no_reference = self.reference is None and self.reference_why == NO_REFERENCE
        return (no_reference or self.reference == 1.0) and self.empty == 0.0


NO_REFERENCE = "no reference solution"


def seed(task: Task, workspace: Path) -> str | None:
    """A fresh workspace for ``task``: its files and its setup; why that failed, if it did."""
    task.materialize(workspace)
    return asyncio.run(setup(task, workspace))


def score_workspace(
    task: Task, workspace: Path, sandbox: Sandbox, runners: ScoringRunners, run_id: str = "score"
) -> ScoreResult:
    """``workspace`` scored as the run scores an execution of ``task`` that finished there."""
    with tempfile.TemporaryDirectory(prefix="gyre-score-task-") as tasks:
        artifacts = RunArtifacts(
            run_id, workspace, "finished", task.for_scorer(Path(tasks)), sandbox.for_task(task)
        )
        return runners.get(task.scorer).score(artifacts)


def verify_task(task: Task, sandbox: Sandbox, runners: ScoringRunners, timeout_s: float) -> Verdict:
    """``task``'s reference and an empty attempt, each in a fresh workspace, scored."""
    got: dict[str, tuple[float | None, str]] = {}
    with tempfile.TemporaryDirectory(prefix="gyre-verify-") as tmp:
        for attempt in ("reference", "empty"):
            if attempt == "reference" and not reference.has_reference(task):
                got[attempt] = None, NO_REFERENCE
                continue
            got[attempt] = attempt_score(
                task, Path(tmp) / attempt, sandbox, runners, timeout_s, attempt == "reference"
            )
    return Verdict(
        reference=got["reference"][0],
        reference_why=got["reference"][1],
        empty=got["empty"][0],
        empty_why=got["empty"][1],
    )


def attempt_score(
    task: Task, workspace: Path, sandbox: Sandbox, runners: ScoringRunners, timeout_s: float, solve: bool
) -> tuple[float | None, str]:
    """What ``task``'s scorer gives a fresh workspace, with its reference applied if ``solve``."""
    task.materialize(workspace)
    sandbox.for_task(task).seed(workspace)
    if (failed := asyncio.run(setup(task, workspace))) is not None:
        return None, failed
    sandbox.prepare(workspace)
    if solve and (failed := reference.apply(task, workspace, sandbox, timeout_s)) is not None:
        return None, failed
    sandbox.prepare(workspace)
    result = score_workspace(task, workspace, sandbox, runners, f"verify-{task.id}")
    return result.reward, result.reason
