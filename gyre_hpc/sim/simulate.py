"""The simulator: the runtime's own step kinds, run on a simulated fleet on a simulated clock.

```
 SimConfig + Workload ──▶ Simulation ──▶ step_kind(scheduler)(ctx).run(k), k = 1 … steps
                            │               (scheduler.steps: colocate, async, elastic, in-flight,
                            │                the classes the MPI runtime runs)
                            ├─ SimFleet     switches, publication, micro-steps claimed and trained
                            ├─ SimSampler   executions on the admitted engines' slots and the pool
                            └─ SimJobs      the workload as the step kinds' data order
                          ──▶ SimResult: step ends, each cell's time split, the switch log, bounds
```

Nothing here dispatches, closes a queue, feeds a trainer or publishes: the step kinds do, through
the ``Fleet`` and ``Sampler`` interfaces, exactly as in the runtime; ``sim.fleet`` only makes time
pass and keeps the books. An execution of the workload becomes a run whose trajectory tree has
one path per micro-step it yields (``sim.fleet.tree_of``), so the runtime's batching makes the
same micro-steps; its reward differs from its group's others, so every run trains. Each
completed step also gets its bounds (``sim.bound``): the work it was served and trained, and,
for steps in series, its on-policy bound from the work it was given.

The workload is a function from a step to its prompt groups: each group's execution durations
and the micro-steps it yields. ``sampled`` draws it from the config's distributions;
``replay`` replays the one a real run recorded.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre_hpc.execution.run_id import dispatched_step, run_id
from gyre_hpc.observability.cell_time import CellTime, cell_totals
from gyre_hpc.recipe.schema import (
    Mode,
    RunConfig,
    SchedulerConfig,
    TasksConfig,
    TrainerConfig,
    TrajectoryConfig,
)
from gyre_hpc.scheduler.policy import Role, initial_roles
from gyre_hpc.scheduler.steps import StepContext, StepRecord, engine_urls, load_serving, step_kind
from gyre_hpc.sim.bound import step_bound, work_bound
from gyre_hpc.sim.config import SimConfig
from gyre_hpc.sim.fleet import TOKENS, Clock, SimFleet, SimJob, SimSampler
from gyre_hpc.trajectory.sequences import pack_micro_steps


@dataclass(frozen=True)
class PromptGroup:
    """One prompt's executions and the training they yield."""

    durations: tuple[float, ...]
    """Each execution's time while served (before ``exec_overhead_s``)."""
    micro_steps: tuple[float, ...]
    """Training time of each micro-step the group yields when packed on its own (streaming)."""
    sequence_tokens: tuple[int, ...] = ()
    """Replayed workloads: the group's sequence lengths, repacked with the whole step when not
    streaming (as the runtime's ``step_batch`` does)."""


Workload = Callable[[int], list[PromptGroup]]


def sampled(cfg: SimConfig) -> Workload:
    """Log-normal durations cut at the timeout; every execution costs ``train_s_per_exec`` of
    training in micro-steps of ``micro_step_s``."""
    rng = random.Random(cfg.seed)
    mu = math.log(cfg.duration_median_s)
    per_exec = max(1, round(cfg.train_s_per_exec / cfg.micro_step_s))

    def groups(step: int) -> list[PromptGroup]:
        return [
            PromptGroup(
                tuple(
                    min(rng.lognormvariate(mu, cfg.duration_sigma), cfg.timeout_s)
                    for _ in range(cfg.group_size)
                ),
                (cfg.micro_step_s,) * (per_exec * cfg.group_size),
            )
            for _ in range(cfg.prompts)
        ]

    return groups


def packed(cfg: SimConfig, sequence_tokens: list[int]) -> tuple[float, ...]:
    """Micro-step times of sequences packed like the runtime packs them."""
    bins = pack_micro_steps(sequence_tokens, cfg.micro_step_tokens)
    return tuple(sum(sequence_tokens[i] for i in b) * cfg.train_s_per_token for b in bins)


@dataclass(kw_only=True)
class SimResult:
    """What one simulated (or observed) run did: its step ends, each cell's time, its switches."""

    mode: Mode
    step_ends: list[float]
    total_s: float
    cells: list[CellTime]
    """Where each cell's time went (``sampling``: its slots busy; a sampling cell holding one
    last execution is mostly ``idle slots``)."""
    switch_log: list[tuple[int, int, str]]
    """(step, cell, role it switched to), in the order the switches began."""
    timeline: list[tuple[int, float, float, str]] = field(default_factory=list)
    """(cell, start, end, what) for a Gantt chart."""
    step_bounds: list[float] = field(default_factory=list)
    """Each completed step's on-policy bound (``sim.bound.step_bound``), from the work it was
    given: it holds only for steps in series (``in_series``)."""
    work_bounds: list[float] = field(default_factory=list)
    """Each completed step's work (``sim.bound.work_bound``): what it was served and trained."""
    publish_s: float = 0.0
    in_series: bool = True
    """Colocate, or elastic without ``carry_tail`` or in-flight updates: no step overlaps another."""

    @property
    def switches(self) -> int:
        return len(self.switch_log)

    @property
    def bound_s(self) -> float:
        """What no schedule of this run's work beats (``sim.bound.run_bound``)."""
        return sum(self.work_bounds) + self.publish_s if self.work_bounds else 0.0

    @property
    def step_bound_s(self) -> float | None:
        """The on-policy bound, where it holds (steps in series); None elsewhere."""
        return sum(self.step_bounds) if self.in_series else None

    def time_split(self) -> dict[str, float]:
        """Shares of cell time by category (``observability.cell_time.CATEGORIES``)."""
        cell_s = self.total_s * len(self.cells) or 1.0
        return {
            what: s / cell_s for what, s in cell_totals(c.as_dict(digits=None) for c in self.cells).items()
        }

    @property
    def step_times(self) -> list[float]:
        return [b - a for a, b in zip([0.0, *self.step_ends], self.step_ends, strict=False)]


class SimJobs:
    """The workload as the step kinds take their data order (``scheduler.steps.Jobs``): each
    step's groups drawn once, in the order the step kinds ask for them."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.groups: dict[int, list[PromptGroup]] = {}

    def step_groups(self, step: int) -> list[PromptGroup]:
        if step not in self.groups:
            self.groups[step] = self.workload(step)
        return self.groups[step]

    def jobs(self, step: int, prompts: int | None = None) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for g, group in enumerate(self.step_groups(step)[:prompts]):
            task, n = f"p{g}", len(group.durations)
            for i, duration in enumerate(group.durations):
                out.append(
                    (run_id(step, task, i), SimJob(task, duration, paths_of(group, i, n), reward(i, n)))
                )
        return out


def paths_of(group: PromptGroup, i: int, n: int) -> tuple[int, ...]:
    """Execution ``i``'s paths (their tokens): a replayed group's sequences dealt out in turn, or
    one path per micro-step it yields (``sim.fleet.TOKENS`` each)."""
    if group.sequence_tokens:
        return group.sequence_tokens[i::n]
    return (TOKENS,) * (len(group.micro_steps) // max(n, 1))


def trains(group: PromptGroup) -> bool:
    """Whether the runtime trains any of the group's runs: their rewards (``reward``) differ, so
    some run's advantage is not 0 (a group of one never trains)."""
    n = len(group.durations)
    return len({reward(i, n) for i in range(n)}) > 1


def reward(i: int, n: int) -> float:
    """Rewards of a group that leave no run at the group's mean (a run at the mean has advantage
    0 and trains nothing): 0, 1, …, n − 1, the last one half more when n is odd."""
    return i + (0.5 if n % 2 and i == n - 1 else 0.0)


class _NoFiles:
    """The run directory a simulated step kind never writes to."""

    def step_workspaces(self, step: int) -> Path:
        return Path("/nonexistent/workspaces") / str(step)

    def journal(self, step: int) -> Path:
        return Path("/nonexistent/journals") / str(step)

    def tito_bytes(self) -> dict[str, int]:
        return {}


class _Events:
    """The step kinds' events, kept in memory."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def emit(self, event: Any) -> Any:
        self.events.append(event)
        return event


class Simulation:
    """One simulated run: its fleet, sampler, data and the step records, kept for inspection."""

    def __init__(self, cfg: SimConfig, mode: Mode, workload: Workload | None = None) -> None:
        self.cfg, self.mode = cfg, mode
        self.clock = Clock()
        self.fleet = SimFleet(self.clock, cfg, initial_roles(mode, cfg.cells, cfg.async_train_cells))
        self.sampler = SimSampler(self.clock, self.fleet, cfg)
        self.fleet.sampler = self.sampler
        self.data = SimJobs(workload or sampled(cfg))
        self.events = _Events()
        self.sched = SchedulerConfig(
            mode=mode,
            async_train_cells=cfg.async_train_cells,
            min_queued_microsteps=cfg.min_queued,
            carry_tail=cfg.carry_tail,
            max_staleness=cfg.max_staleness if mode == "elastic" else 0,
            lookahead=cfg.lookahead,
        )
        self.records: list[StepRecord] = []

    def context(self) -> StepContext:
        cfg = self.cfg
        tokens = cfg.micro_step_tokens if cfg.train_s_per_token else TOKENS
        return StepContext(
            fleet=self.fleet,
            sampler=self.sampler,
            events=self.events,  # type: ignore[arg-type]
            run_dir=_NoFiles(),
            data=self.data,
            run=RunConfig(steps=cfg.steps, seed=cfg.seed),
            scheduler=self.sched,
            tasks=TasksConfig(prompts_per_step=cfg.prompts, group_size=cfg.group_size),
            trajectory=TrajectoryConfig(jmax=100_000, packing="paths"),
            trainer=TrainerConfig(micro_step_tokens=tokens, checkpoint_every=cfg.checkpoint_every),
            clock=self.clock,
        )

    def run(self) -> SimResult:
        """Every step, as the runtime's controller runs them: the engines that sample admitted
        first, then one step kind's ``run`` per step."""
        f = self.fleet
        sampling = [u for u, r in sorted(f.roles.items()) if r == Role.SAMPLING]
        load_serving(f, self.sampler, sampling)
        self.sampler.set_sampling(engine_urls(f, sampling))
        kind = step_kind(self.sched)(self.context())
        ends = []
        for step in range(1, self.cfg.steps + 1):
            self.records.append(kind.run(step))
            ends.append(self.clock.now)
        f.close_books()
        cells = [b.time() for b in f.books]
        plain = self.mode == "elastic" and not self.sched.carry_tail and not self.sched.max_staleness
        log = [(bisect.bisect_right(ends, t) + 1, cell, role) for t, cell, role in f.switches]
        return SimResult(
            mode=self.mode,
            step_ends=ends,
            total_s=self.clock.now,
            cells=cells,
            switch_log=log,
            timeline=f.timeline,
            step_bounds=self.bounds(),
            work_bounds=self.works(),
            publish_s=self.cfg.publish_s,
            in_series=self.mode == "colocate" or plain,
        )

    def bounds(self) -> list[float]:
        """Each step's on-policy bound, from the work it was given: a group whose runs all get
        one reward trains nothing (``trains``), so none of its micro-steps is charged."""
        steps = range(1, self.cfg.steps + 1)
        given = [self.data.step_groups(s) for s in steps]
        return [
            step_bound([g.durations for g in gs], [g.micro_steps if trains(g) else () for g in gs], self.cfg)
            for gs in given
        ]

    def works(self) -> list[float]:
        """Each step's served and trained work: an execution's served time goes to the step it
        was dispatched for, a micro-step's to the step that trained it."""
        served: dict[int, float] = {}
        for run, seconds in self.sampler.served.items():
            served[dispatched_step(run)] = served.get(dispatched_step(run), 0.0) + seconds
        trained = self.fleet.trained_s
        steps = range(1, self.cfg.steps + 1)
        return [work_bound(served.get(s, 0.0), trained.get(s, 0.0), self.cfg) for s in steps]


def simulate(cfg: SimConfig, mode: Mode, workload: Workload | None = None) -> SimResult:
    return Simulation(cfg, mode, workload).run()
