"""An in-process fleet and sampler on a scripted clock, so the step kinds run unchanged without
MPI or HTTP.

```
 Clock: the simulator's (``sim.fleet.Clock``): it moves only when the step waits (Fleet.receive,
        a switch, a load, an apply), and then to the next scripted event: no wall-clock time.
 FakeSampler: each execution ends after its scripted duration with a one-call trajectory tree
              and its scripted reward (its call is served by the version the fleet held when it
              was dispatched); the TITO log grows by one byte per call; ``stop_runs`` ends one
              at once, status "stopped"
 FakeFleet:   switches, loads and applies take scripted times; training cells claim micro-steps
              with the real ``Claims``/``work_once`` from a shared counter, each costing its tokens
```

Fakes stand only where the real parts are MPI ranks and HTTP servers; what decides and what
counts is the runtime's own code.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Callable
from pathlib import Path

from gyre_hpc.execution.outcome import Execution, Outcome, ScoreResult
from gyre_hpc.loss.token_stats import TokenStats
from gyre_hpc.runtime.protocol import Hello, StepApplied, TrainDone
from gyre_hpc.scheduler.policy import Role
from gyre_hpc.sim.fleet import Clock
from gyre_hpc.tasks.task import Task
from gyre_hpc.trainer.base import MicroStats, micro_stats
from gyre_hpc.trainer.data_parallel import Claims, work_once
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
                Execution(run, task.id, workspaces / run, status=status, calls=1),
                ScoreResult(run, "scored", self.reward(run), 1),
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


class _Trainer:
    """What ``work_once`` calls: a micro-step that computes nothing (its cost is the clock's)."""

    def micro_step(self, sequences: list) -> MicroStats:
        return micro_stats(sequences, 0.0)

    def gradient(self) -> None:
        """No gradient: the fleet's clock stands for the whole step."""


class FakeFleet:
    def __init__(
        self,
        clock: Clock,
        capacities: list[int],
        pool: list[int] = (),  # type: ignore[assignment]
        switch_s: float = 0.2,
        load_s: float = 0.1,
        apply_s: float = 0.3,
        s_per_token: float = 0.02,
    ) -> None:
        self.clock = clock
        self.cells = len(capacities)
        self.units = {
            u: Hello(
                cell=u,
                rank=u + 1,
                host="fake",
                pid=0,
                addresses=(f"fake://{u}",),
                capacity=cap,
                standalone=u >= self.cells,
            )
            for u, cap in enumerate([*capacities, *pool])
        }
        self.roles = dict.fromkeys(self.units, Role.IDLE)
        self.version = 0
        self.switch_s, self.load_s, self.apply_s, self.s_per_token = switch_s, load_s, apply_s, s_per_token
        self.inbox: deque[TrainDone] = deque()
        self.sessions: dict[int, tuple[int, Claims, float]] = {}
        self.busy: set[int] = set()
        self.counter = 0
        self.switched: list[tuple[float, int, str]] = []
        self.applied: list[tuple[int, list[int], int]] = []
        self.states: list[dict] = []
        """What each ``apply`` was asked to store with its checkpoint."""
        self._trainer = _Trainer()

    # ---- the Fleet interface --------------------------------------------------------------------

    def start(self) -> None:
        pass

    def switch(self, roles: dict[int, Role]) -> dict[int, float]:
        changing = {c: r for c, r in roles.items() if self.roles[c] != r}
        if not changing:
            return {}
        for cell in changing:
            if cell in self.sessions:
                raise AssertionError(f"cell {cell}: role switch while training step {self.sessions[cell][0]}")
        self.clock.sleep(self.switch_s)
        for cell, role in changing.items():
            self.roles[cell] = role
            self.switched.append((self.clock.now, cell, str(role)))
        return dict.fromkeys(changing, self.switch_s)

    def load_weights(self, units: list[int]) -> float:
        if units:
            self.clock.sleep(self.load_s)
        return self.load_s if units else 0.0

    def train(self, cells: list[int], step: int, queue: list, closed: bool) -> None:
        for cell in cells:
            assert self.roles[cell] == Role.TRAINING, f"cell {cell} asked to train while {self.roles[cell]}"
            self.sessions[cell] = (step, Claims.of(queue, closed), self.clock.now)
            self._work(cell)

    def extend(self, cells: list[int], step: int, items: list) -> None:
        for cell in cells:
            self.sessions[cell][1].queue += items
            self._work(cell)

    def close_queue(self, cells: list[int], step: int, total: int, stop: bool) -> None:
        for cell in cells:
            self.sessions[cell][1].close(total, stop)
            self._work(cell)

    def reset_claims(self) -> None:
        self.counter = 0

    def claimed(self) -> int:
        return self.counter

    def receive(self) -> TrainDone | None:
        if self.inbox:
            return self.inbox.popleft()
        if not self.clock.advance():
            raise AssertionError("nothing left to happen, yet the step waits")
        return None

    def apply(
        self, step: int, done: dict[int, TrainDone], num_runs: int, checkpoint: bool, state: dict
    ) -> StepApplied:
        self.clock.sleep(self.apply_s)
        self.version += 1 if num_runs else 0
        self.applied.append((step, sorted(i for d in done.values() for i in d.claimed), num_runs))
        self.states.append(state)
        return StepApplied(step, self.version, 0.0, self.apply_s, "")

    def shutdown(self, reason: str) -> None:
        pass

    # ---- the transport's counter, as work_once claims from it -------------------------------------

    def claim(self) -> int:
        self.counter += 1
        return self.counter - 1

    # ---- a training cell ------------------------------------------------------------------------

    def _work(self, cell: int) -> None:
        """What a cell leader does between messages: one claim or micro-step of its session."""
        if cell in self.busy or cell not in self.sessions:
            return
        step, claims, started = self.sessions[cell]
        state = work_once(claims, self._trainer, self)  # type: ignore[arg-type]
        if state == "trained":
            self.busy.add(cell)
            cost = claims.stats[-1].tokens * self.s_per_token
            self.clock.after(cost, lambda: (self.busy.discard(cell), self._work(cell)))
        elif state == "done":
            del self.sessions[cell]
            seconds = self.clock.now - started
            self.inbox.append(
                TrainDone(cell, step, claims.claimed, claims.loss_sum, claims.tokens, TokenStats(), seconds)
            )
