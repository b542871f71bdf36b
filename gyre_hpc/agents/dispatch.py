"""Running many executions at once against the proxy, reporting the scheduler's counters.

Each execution gets its own run id, workspace and per-role keys. ``on_event`` hears
``dispatched`` (d), ``started`` (p) and ``finished`` (f) for every execution — the counters
of the water-level rule — and each finished execution is scored at once on what it left.

With a journal, an execution the journal shows finished is not run again (its outcome is
returned as it was, with the same d / p / f events), and one it shows under way continues
from its last completed call in the workspace it left.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gyre_hpc.agents.harness import Execution, Harness
from gyre_hpc.agents.journal import Journal
from gyre_hpc.scoring import RunArtifacts, ScoreResult, ScoringRunner
from gyre_hpc.tasks.task import Task


@dataclass
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
            Execution(**{**fields, "workspace": Path(fields["workspace"])}), ScoreResult(**data["score"])
        )


def artifacts(ex: Execution, task: Task, task_dir: Path) -> RunArtifacts:
    """A run that never reached the model at all left nothing of its own: it gets a placeholder."""
    workspace = ex.workspace if not (ex.status == "crashed" and ex.calls == 0) else ex.workspace / "missing"
    status = "finished" if ex.status == "finished" else "timed_out" if ex.status == "timed_out" else "crashed"
    return RunArtifacts(ex.run_id, workspace, status, task.verifier(task_dir))


class Dispatcher:
    def __init__(
        self,
        harness: Harness,
        scoring: Callable[[Task], ScoringRunner],
        workspaces: Path,
        task_dir: Path,
        concurrency: int,
        on_event: Callable[[str, str], None] = lambda kind, run: None,
        on_outcome: Callable[[Outcome], None] = lambda outcome: None,
        journal: Journal | None = None,
    ) -> None:
        self.harness, self.scoring, self.journal = harness, scoring, journal
        self.workspaces, self.task_dir = workspaces, task_dir
        self.limit = asyncio.Semaphore(concurrency)
        self.on_event = on_event
        self.on_outcome = on_outcome

    async def run_all(self, jobs: list[tuple[str, Task]]) -> list[Outcome]:
        for run_id, _ in jobs:
            self.on_event("dispatched", run_id)
        return list(await asyncio.gather(*(self._one(run_id, task) for run_id, task in jobs)))

    async def _one(self, run_id: str, task: Task) -> Outcome:
        entry = self.journal.load(run_id) if self.journal is not None else None
        if entry is not None and entry.outcome is not None:  # finished before a restart: kept as it was
            self.on_event("started", run_id)
            outcome = Outcome.from_json(entry.outcome)
            self.on_outcome(outcome)
            self.on_event("finished", run_id)
            return outcome
        async with self.limit:
            self.on_event("started", run_id)
            workspace = self.workspaces / run_id
            if entry is None or entry.calls == 0:
                shutil.rmtree(workspace, ignore_errors=True)  # an abandoned attempt's files go
                task.materialize(workspace)
            ex = await self.harness.run(task, workspace, run_id, self.journal, entry)
            score = await asyncio.to_thread(self.scoring(task).score, artifacts(ex, task, self.task_dir))
            outcome = Outcome(ex, score)
            if self.journal is not None and ex.status != "crashed":
                # A crash may be the failure a restart recovers from: such an execution continues.
                self.journal.finish(run_id, outcome.to_json())
            self.on_outcome(outcome)  # before "finished": a consumer counting f sees it first
            self.on_event("finished", run_id)
            return outcome
