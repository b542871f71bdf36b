"""A simulated fleet and sampler on a simulated clock: the runtime's step kinds run on them.

```
 Clock       a heap of (time, callback); it moves only when a step kind waits (Fleet.receive, a
             switch, a load, an apply), and then to the next event: no sleeps, no wall clock
 SimSampler  executions take the slots of the engines admitted (``set_sampling``) and of the
             pool, first come first served; each ends after its served time with a tree of one
             path per micro-step it yields; ``stop_runs`` ends one at once (``stopped``)
 SimFleet    switches and applies take the config's times; training cells claim micro-steps
             from one counter (claim, then wait for it if not packed yet, as ``work_once``),
             each costing its tokens × seconds per token
```

What decides and what counts is the step kinds' own code (``scheduler.steps``); this module
only makes time pass and keeps the books each cell's time split is made of. It knows nothing of
MPI, HTTP, models or files.
"""

from __future__ import annotations

import concurrent.futures
import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_hpc.execution.outcome import Execution, Outcome, ScoreResult
from gyre_hpc.observability.cell_time import CellTime
from gyre_hpc.observability.events import Hello
from gyre_hpc.scheduler.fleet import StepApplied, TrainDone
from gyre_hpc.scheduler.policy import Role
from gyre_hpc.sim.config import SimConfig
from gyre_hpc.step.claims import Claims, MicroStats, micro_stats, work_once
from gyre_hpc.trajectory.records import CallMeta, TitoRecord
from gyre_hpc.trajectory.sequences import StepQueue, TrainSequence
from gyre_hpc.trajectory.tree import TrajectoryTree

TOKENS = 16
"""Tokens of one simulated path: one micro-step each (``trainer.micro_step_tokens``)."""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._n = 0

    def __call__(self) -> float:
        return self.now

    def after(self, seconds: float, fn: Callable[[], None]) -> None:
        self._n += 1
        heapq.heappush(self._heap, (self.now + seconds, self._n, fn))

    def advance(self) -> bool:
        """Run the next event; False when nothing is left to happen."""
        if not self._heap:
            return False
        t, _, fn = heapq.heappop(self._heap)
        self.now = max(self.now, t)
        fn()
        return True

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass, running whatever happens meanwhile."""
        until = self.now + seconds
        while self._heap and self._heap[0][0] <= until:
            self.advance()
        self.now = until


@dataclass(frozen=True)
class SimJob:
    """What a simulated execution is: its served time and the paths it yields (their tokens)."""

    task_id: str
    duration: float
    paths: tuple[int, ...]
    reward: float


@dataclass
class CellBook:
    """One cell's seconds in each state so far (``sampling`` with its slots busy or not), and the
    state it is in."""

    sampling: float = 0.0
    training: float = 0.0
    idle: float = 0.0
    switching: float = 0.0
    idle_slots: float = 0.0
    """Of ``sampling``, the part its slots stood empty."""
    state: str = "sampling"
    since: float = 0.0
    occupied_at: float = 0.0

    def time(self) -> CellTime:
        """Where the cell's time went, in the categories every picture of cell time draws."""
        busy = self.sampling - self.idle_slots
        return CellTime(
            sampling=busy,
            idle_slots=self.idle_slots,
            training=self.training,
            idle=self.idle,
            switching=self.switching,
        )


class SimSampler:
    def __init__(self, clock: Clock, fleet: SimFleet, cfg: SimConfig) -> None:
        self.clock, self.fleet, self.cfg = clock, fleet, cfg
        self.admitted: set[str] = set()
        self.held: set[str] = set()
        self.waiting: deque[tuple[str, SimJob, Callable[[str, str], None]]] = deque()
        self.running: dict[str, Callable[[str, str], None]] = {}
        self.started: dict[str, float] = {}
        self.served: dict[str, float] = {}
        """Run → the time it held a slot, once it ended."""
        self.durations: dict[str, float] = {}
        """Run → the time it takes when nothing stops it (its duration and overhead)."""
        self.finished_trees: dict[str, TrajectoryTree] = {}
        self.stopped: list[str] = []
        self._trees: dict[tuple[tuple[int, ...], int], TrajectoryTree] = {}
        self.occupied = 0.0
        """∫ occupied slots / slots dt: the busy share of sampling time."""
        self._last = 0.0

    # ---- slots ----------------------------------------------------------------------------------

    def slots(self) -> int:
        return sum(self.fleet.capacity(url) for url in self.admitted - self.held)

    def _book(self) -> None:
        """Close the occupancy integral up to now (before slots or running change)."""
        slots = self.slots()
        share = min(len(self.running), slots) / slots if slots else 1.0
        self.occupied += (self.clock.now - self._last) * share
        self._last = self.clock.now

    def _start(self) -> None:
        while self.waiting and len(self.running) < self.slots():
            run, job, end = self.waiting.popleft()
            self._book()
            self.running[run] = end
            self.started[run] = self.clock.now
            self.clock.after(
                job.duration + self.cfg.exec_overhead_s, lambda run=run: self._end(run, "finished")
            )

    def _end(self, run: str, status: str) -> None:
        if run not in self.running:
            return  # stopped before its natural end
        self._book()
        end = self.running.pop(run)
        self.served[run] = self.clock.now - self.started[run]
        end(run, status)
        self._start()

    # ---- the Sampler interface ------------------------------------------------------------------

    def dispatch(
        self,
        jobs: list[tuple[str, Any]],
        workspaces: Path,
        on_outcome: Callable[[Outcome], None],
        journal: Path | None = None,
    ) -> concurrent.futures.Future[list[Outcome]]:
        future: concurrent.futures.Future[list[Outcome]] = concurrent.futures.Future()
        outcomes: dict[str, Outcome] = {}
        by_run = dict(jobs)
        version = self.fleet.version

        def end(run: str, status: str) -> None:
            job: SimJob = by_run[run]
            if job.paths:
                self.finished_trees[run] = self.tree_of(job.paths, version).relabeled(run)
            kind = "scored" if status == "finished" else "partial"
            ex = Execution(
                run_id=run,
                task_id=job.task_id,
                workspace=workspaces / run,
                status=status,
                calls=len(job.paths),
            )
            score = ScoreResult(run_id=run, kind=kind, reward=job.reward, attempts=1)
            outcomes[run] = Outcome(execution=ex, score=score)
            on_outcome(outcomes[run])
            if len(outcomes) == len(jobs):
                future.set_result([outcomes[r] for r, _ in jobs])

        for run, job in jobs:
            self.durations[run] = job.duration + self.cfg.exec_overhead_s
            self.waiting.append((run, job, end))
        self._start()
        if not jobs:
            future.set_result([])
        return future

    def stop_runs(self, run_ids: list[str]) -> None:
        for run in run_ids:
            for i, (waiting, _, end) in enumerate(self.waiting):
                if waiting == run:  # never started: it ends having been served nothing
                    del self.waiting[i]
                    self.started[run] = self.clock.now
                    self.running[run] = end
                    break
            if run in self.running:
                self.stopped.append(run)
                self._end(run, "stopped")

    def tree_of(self, paths: tuple[int, ...], version: int) -> TrajectoryTree:
        """The tree of a run with these paths, served at ``version``: built once per shape."""
        key = (paths, version)
        if key not in self._trees:
            self._trees[key] = tree_of("", paths, version)
        return self._trees[key]

    def trees(self, run_ids: list[str]) -> dict[str, TrajectoryTree]:
        return {r: self.finished_trees[r] for r in run_ids if r in self.finished_trees}

    def set_sampling(self, urls: set[str]) -> None:
        self._book()
        self.admitted = set(urls)
        self._start()

    def hold(self, urls: set[str]) -> None:
        self._book()
        self.held |= urls

    def loaded(self, urls: set[str], version: int) -> None:
        self._book()
        self.held -= urls
        self._start()


def tree_of(run: str, paths: tuple[int, ...], version: int) -> TrajectoryTree:
    """A tree with one path of each of these lengths (a prompt token, the rest output); no two
    share a prefix, so each is trained on its own."""
    records = [
        TitoRecord(
            run, f"c{j}", "main", [1 + j], [100] * (n - 1), [-1.0] * (n - 1), CallMeta(policy_version=version)
        )
        for j, n in enumerate(paths)
    ]
    return TrajectoryTree.from_records(records)


@dataclass
class _StepTraining:
    """A training cell's part in one step: its claims (``step.claims``) and when it joined."""

    step: int
    claims: Claims
    started: float


class _Trainer:
    """What ``work_once`` calls on a simulated cell: a micro-step computes nothing here, its
    time is the clock's (its tokens × seconds per token)."""

    def micro_step(self, sequences: list[TrainSequence]) -> MicroStats:
        return micro_stats(sequences, 0.0)

    def gradient(self) -> None:
        """No gradient: the apply's time stands for the sum."""


class SimFleet:
    def __init__(self, clock: Clock, cfg: SimConfig, roles: list[Role]) -> None:
        self.clock, self.cfg = clock, cfg
        self.cells = cfg.cells
        caps = [cfg.capacity] * cfg.cells + ([cfg.pool_capacity] if cfg.pool_capacity else [])
        self.units = {
            u: Hello(
                cell=u,
                rank=u + 1,
                host="sim",
                pid=0,
                addresses=(f"sim://{u}",),
                capacity=cap,
                standalone=u >= cfg.cells,
            )
            for u, cap in enumerate(caps)
        }
        self._capacity = {f"sim://{u}": cap for u, cap in enumerate(caps)}
        self.roles = {u: (roles[u] if u < cfg.cells else Role.SAMPLING) for u in self.units}
        self.version = 0
        self.sessions: dict[int, _StepTraining] = {}
        self.busy: set[int] = set()
        self.inbox: deque[TrainDone] = deque()
        self.counter = 0
        self.switches: list[tuple[float, int, str]] = []
        """(when it began, cell, the role it switched to), in order."""
        self.books = [
            CellBook(state="sampling" if roles[c] == Role.SAMPLING else "idle") for c in range(cfg.cells)
        ]
        self.timeline: list[tuple[int, float, float, str]] = []
        self.sampler: SimSampler | None = None
        self.trained_s: dict[int, float] = {}
        """Step → the cell-seconds its micro-steps took."""
        self.applied: list[tuple[int, list[int], int]] = []
        """Each apply: (step, the micro-steps its cells trained, runs the loss is averaged over)."""
        self.states: list[dict] = []
        """What each apply was asked to keep with its checkpoint."""
        self._trainer = _Trainer()

    def capacity(self, url: str) -> int:
        return self._capacity[url]

    # ---- books ----------------------------------------------------------------------------------

    def mark(self, cell: int, what: str) -> None:
        """Close the cell's current segment and open ``what``."""
        b, now = self.books[cell], self.clock.now
        if b.state == what:
            return
        span = now - b.since
        setattr(b, b.state, getattr(b, b.state) + span)
        if b.state == "sampling" and self.sampler is not None:
            self.sampler._book()
            b.idle_slots += max(span - (self.sampler.occupied - b.occupied_at), 0.0)
        if span > 0:
            self.timeline.append((cell, b.since, now, b.state))
        b.state, b.since = what, now
        if self.sampler is not None:
            b.occupied_at = self.sampler.occupied

    def close_books(self) -> None:
        for c in range(self.cells):
            state = self.books[c].state
            self.mark(c, "sampling" if state != "sampling" else "idle")

    # ---- the Fleet interface --------------------------------------------------------------------

    def start(self) -> None:
        pass

    def switch(self, roles: dict[int, Role]) -> dict[int, float]:
        changing = {c: r for c, r in roles.items() if self.roles[c] != r}
        if not changing:
            return {}
        if training := sorted(c for c in changing if c in self.sessions):
            raise RuntimeError(f"simulated fleet: cells {training} switched while training a step")
        to_train = any(r == Role.TRAINING for r in changing.values())
        cost = self.cfg.switch_to_train_s if to_train else self.cfg.switch_to_sample_s
        for cell, role in changing.items():
            self.roles[cell] = role
            self.switches.append((self.clock.now, cell, str(role)))
            self.mark(cell, "switching")
        self.clock.sleep(cost)
        for cell, role in changing.items():
            self.mark(cell, "sampling" if role == Role.SAMPLING else "idle")
        return dict.fromkeys(changing, cost)

    def load_weights(self, units: list[int]) -> float:
        """Every listed engine loads at once, in ``load_s`` (sampled workloads fold the loads into
        ``publish_s``: 0 by default)."""
        if units and self.cfg.load_s:
            self.clock.sleep(self.cfg.load_s)
        return self.cfg.load_s if units else 0.0

    def train(self, cells: list[int], step: int, queue: StepQueue, closed: bool) -> None:
        for cell in cells:
            if self.roles[cell] != Role.TRAINING:
                raise RuntimeError(f"simulated fleet: cell {cell} asked to train while {self.roles[cell]}")
            self.sessions[cell] = _StepTraining(step, Claims.of(queue, closed), self.clock.now)
            self._work(cell)

    def extend(self, cells: list[int], step: int, items: StepQueue) -> None:
        for cell in cells:
            self.sessions[cell].claims.queue += items
            self._work(cell)

    def close_queue(self, cells: list[int], step: int, total: int, stop: bool) -> None:
        for cell in cells:
            self.sessions[cell].claims.close(total, stop)
            self._work(cell)

    def reset_claims(self) -> None:
        self.counter = 0

    def claimed(self) -> int:
        return self.counter

    def receive(self) -> TrainDone | None:
        if self.inbox:
            return self.inbox.popleft()
        if not self.clock.advance():
            raise RuntimeError("simulated fleet: nothing left to happen, yet the step waits")
        return None

    def apply(
        self, step: int, done: dict[int, TrainDone], num_runs: int, checkpoint: bool, state: dict
    ) -> StepApplied:
        self.clock.sleep(self.cfg.publish_s)
        self.version += 1 if num_runs else 0
        self.applied.append((step, sorted(i for d in done.values() for i in d.claimed), num_runs))
        self.states.append(state)
        return StepApplied(
            step=step, version=self.version, grad_norm=0.0, seconds=self.cfg.publish_s, checkpoint=""
        )

    def shutdown(self, reason: str) -> None:
        pass

    # ---- a training cell ------------------------------------------------------------------------

    def claim(self) -> int:
        """The step's one counter (``step.claims.Counter``)."""
        self.counter += 1
        return self.counter - 1

    def _work(self, cell: int) -> None:
        """What a cell leader does between messages: one claim or micro-step (``work_once``),
        its time charged on the clock."""
        s = self.sessions.get(cell)
        if s is None or cell in self.busy:
            return
        state = work_once(s.claims, self._trainer, self)
        if state == "trained":
            seconds = s.claims.stats[-1].tokens * self.s_per_token
            self.trained_s[s.step] = self.trained_s.get(s.step, 0.0) + seconds
            self.busy.add(cell)
            self.mark(cell, "training")
            self.clock.after(seconds, lambda: self._trained(cell))
        elif state == "done":
            del self.sessions[cell]
            self.inbox.append(TrainDone.of(cell, s.step, s.claims, self.clock.now - s.started))

    def _trained(self, cell: int) -> None:
        self.busy.discard(cell)
        self.mark(cell, "idle")
        self._work(cell)

    @property
    def s_per_token(self) -> float:
        """One cell's training time per token: replayed, as measured; sampled, one micro-step
        of ``TOKENS`` costs ``micro_step_s``."""
        return self.cfg.train_s_per_token or self.cfg.micro_step_s / TOKENS
