"""A scripted sampler for the step kinds, on the simulator's clock and beside its fleet.

```
 Clock:       the simulator's (``sim.fleet.Clock``): it moves only when the step waits (Fleet.receive,
              a switch, a load, an apply), and then to the next scripted event: no wall-clock time.
 fleet:       the simulator's (``sim.fleet.SimFleet``): switches, loads and applies take the
              config's times, training cells claim through the real ``step.claims.work_once``
 FakeSampler: each execution ends after its scripted duration, whatever the slots, with a one-call
              trajectory tree and its scripted reward (its call is served by the version the fleet
              held when it was dispatched); the TITO log grows by one byte per call; ``stop_runs``
              ends one at once, status "stopped"
```

Fakes stand only where the real parts are MPI ranks and HTTP servers; what decides and what
counts is the runtime's own code.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from pathlib import Path

from gyre_hpc.execution.outcome import Execution, Outcome, ScoreResult
from gyre_hpc.sim.fleet import Clock
from gyre_hpc.tasks.task import Task
from gyre_hpc.trajectory.records import CallMeta, TitoRecord
from gyre_hpc.trajectory.tree import TrajectoryTree


class FakeSampler:
    def __init__(
        self,
        clock: Clock,
        version: Callable[[], int],
        duration: Callable[[str], float],
        reward: Callable[[str], float],
        tito_log: Path,
        output_tokens: int = 10,
    ) -> None:
        self.clock, self.version, self.duration, self.reward = clock, version, duration, reward
        self.tito_log, self.output_tokens = tito_log, output_tokens
        self.finished_trees: dict[str, TrajectoryTree] = {}
        self.admitting: list[tuple[float, set[str]]] = []
        self.held: list[tuple[float, set[str]]] = []
        self.loads: list[tuple[float, set[str], int]] = []
        self.stoppers: dict[str, Callable[[], None]] = {}
        self.stopped: list[tuple[float, str]] = []

    def dispatch(
        self,
        jobs: list[tuple[str, Task]],
        workspaces: Path,
        on_outcome: Callable[[Outcome], None],
        journal: Path | None = None,
    ) -> concurrent.futures.Future[list[Outcome]]:
        future: concurrent.futures.Future[list[Outcome]] = concurrent.futures.Future()
        outcomes: dict[str, Outcome] = {}
        served = self.version()

        def finish(run: str, task: Task, status: str = "finished") -> None:
            if run in outcomes:
                return  # stopped before its scripted end
            self.stoppers.pop(run, None)
            n = self.output_tokens
            record = TitoRecord(
                run, "c0", "main", [1, 2, 3], range(10, 10 + n), [-1.0] * n, CallMeta(policy_version=served)
            )
            self.finished_trees[run] = TrajectoryTree.from_records([record])
            with self.tito_log.open("ab") as fh:  # the log grows by one byte per call here
                fh.write(b"c")
            outcome = Outcome(
                execution=Execution(
                    run_id=run, task_id=task.id, workspace=workspaces / run, status=status, calls=1
                ),
                score=ScoreResult(run_id=run, kind="scored", reward=self.reward(run), attempts=1),
            )
            outcomes[run] = outcome
            on_outcome(outcome)
            if len(outcomes) == len(jobs):
                future.set_result([outcomes[r] for r, _ in jobs])

        for run, task in jobs:
            self.clock.after(self.duration(run), lambda run=run, task=task: finish(run, task))
            self.stoppers[run] = lambda run=run, task=task: finish(run, task, "stopped")
        return future

    def stop_runs(self, run_ids: list[str]) -> None:
        for run in run_ids:
            if run in self.stoppers:
                self.stopped.append((self.clock.now, run))
                self.stoppers[run]()

    def trees(self, run_ids: list[str]) -> dict[str, TrajectoryTree]:
        return {r: self.finished_trees[r] for r in run_ids if r in self.finished_trees}

    def set_sampling(self, urls: set[str]) -> None:
        self.admitting.append((self.clock.now, set(urls)))

    def hold(self, urls: set[str]) -> None:
        self.held.append((self.clock.now, set(urls)))

    def loaded(self, urls: set[str], version: int) -> None:
        self.loads.append((self.clock.now, set(urls), version))
