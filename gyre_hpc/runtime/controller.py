"""The controller (rank 0): brings the cells up and runs the RL step loop.

```
 start ─▶ Hello from every cell (fleet.start) ─▶ proxy + harness up (serving thread)
       ─▶ initial roles (policy) ─▶ every engine loads v (0, or the resumed checkpoint's version)
       ─▶ held-out evaluation of v0 (tasks.eval_every; not on a resume)
       ─▶ ┌─ step k: the step kind of scheduler.mode (scheduler.steps)────────────────────────┐
          │ dispatch ─▶ harness ⇄ proxy ⇄ engines (d / p / f) ─▶ trajectory trees ─▶ micro-steps │
          │ cells the policy sends train them ─▶ the core applies v+1 (checkpoint when due)       │
          │ ─▶ boundary: engines load v+1, trainers return as the policy says                     │
          └─▶ step event + cells' time ─▶ trackers ─▶ held-out evaluation ─▶ metrics.png, cells.png ┘
       ─▶ Goodbye ─▶ barrier                 (SIGUSR2: the step under way checkpoints, then this)
```

The controller owns the run loop only: which step kind runs a step, what is recorded after it
(the step event, completed with where each cell's time went and the weight loads, and handed to
the trackers), evaluations and the plots. It talks to cells only through its ``Fleet``, to executions only
through ``Serving``, and records what happens only through the event log.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gyre_hpc.execution.outcome import group_rewards, mean_reward, pass_rate
from gyre_hpc.execution.run_id import eval_run_id
from gyre_hpc.faults.points import FaultPoints
from gyre_hpc.observability import events as ev
from gyre_hpc.observability.cell_time import CellHours
from gyre_hpc.observability.plot import plot_cells, plot_run
from gyre_hpc.observability.tracking import Trackers
from gyre_hpc.recipe.schema import RunConfig, SchedulerConfig, TasksConfig, TrainerConfig, TrajectoryConfig
from gyre_hpc.rundir import RunDir
from gyre_hpc.runtime import resume
from gyre_hpc.runtime.fleet import Loads
from gyre_hpc.runtime.serving import Serving
from gyre_hpc.scheduler.fleet import Fleet
from gyre_hpc.scheduler.policy import Role, initial_roles
from gyre_hpc.scheduler.steps import (
    StepContext,
    engine_limits,
    engine_urls,
    load_serving,
    step_event,
    step_kind,
    wait_for,
)
from gyre_hpc.tasks.data_order import DataOrder
from gyre_hpc.tasks.suites import load_suite

log = logging.getLogger(__name__)

MakeServing = Callable[[dict[str, int], Callable[[str, str], None]], Serving]


class Controller:
    def __init__(
        self,
        *,
        fleet: Fleet,
        make_serving: MakeServing,
        events: ev.EventLog,
        run_dir: RunDir,
        run: RunConfig,
        scheduler: SchedulerConfig,
        tasks: TasksConfig,
        trajectory: TrajectoryConfig,
        trainer: TrainerConfig,
        first_step: int = 1,
        checkpoint_now: threading.Event | None = None,
        watch: Watch | None = None,
        faults: FaultPoints | None = None,
    ) -> None:
        self.fleet, self.make_serving, self.events, self.run_dir = fleet, make_serving, events, run_dir
        self.run_cfg, self.scheduler, self.tasks = run, scheduler, tasks
        self.trajectory, self.trainer = trajectory, trainer
        self.first_step = first_step
        self.checkpoint_now = checkpoint_now or threading.Event()
        self.watch = watch or Watch()
        self.faults = faults or FaultPoints()
        self._lock = threading.Lock()
        self.counters = Counter[str]()

    def run(self) -> None:
        f = self.fleet
        f.start()
        self.serving = self.make_serving(engine_limits(f.units), self.on_run_event)
        self.events.emit(ev.ProxyUp(url=self.serving.start()))
        failed, reason = True, "completed"
        try:
            roles = initial_roles(self.scheduler.mode, f.cells, self.scheduler.async_train_cells)
            roles += [Role.SAMPLING] * (len(f.units) - f.cells)  # standalone engines only ever sample
            f.switch(dict(enumerate(roles)))
            # Only engines that serve load: a training cell's engine may hold no memory now, and
            # it loads the version in force when it switches to sampling.
            sampling = [u for u, r in sorted(f.roles.items()) if r == Role.SAMPLING]
            load_serving(f, self.serving, sampling)
            self.serving.set_sampling(engine_urls(f, sampling))
            data = DataOrder(self.tasks, self.run_cfg.seed)
            ctx = StepContext(
                fleet=f,
                sampler=self.serving,
                events=self.events,
                run_dir=self.run_dir,
                data=data,
                run=self.run_cfg,
                scheduler=self.scheduler,
                tasks=self.tasks,
                trajectory=self.trajectory,
                trainer=self.trainer,
                checkpoint_now=self.checkpoint_now,
            )
            kind = step_kind(self.scheduler)(ctx)
            if self.tasks.eval_every and self.first_step == 1:
                self.evaluate(0)  # where the held-out curve starts: the policy before any update
            for step in range(self.first_step, self.run_cfg.steps + 1):
                cpu = cpu_seconds()
                record = kind.run(step)
                event = step_event(record, ctx.clock(), f.roles)
                event = replace(event, controller_cpu_s=round(cpu_seconds() - cpu, 3), **self.watched())
                self.faults.reach("record")
                if record.applied.checkpoint:  # it counts from now: a resume starts after it
                    resume.mark_recorded(Path(record.applied.checkpoint), event)
                self.faults.reach("emit")
                self.watch.trackers.record(self.events.emit(event))
                if self.tasks.eval_every and step % self.tasks.eval_every == 0:
                    self.evaluate(step)
                self.plot()
                if self.checkpoint_now.is_set() and record.applied.checkpoint and step < self.run_cfg.steps:
                    self.events.emit(ev.Preempted(step=step, checkpoint=record.applied.checkpoint))
                    self.run_dir.request_requeue(step)
                    reason = "preempted"
                    break
            failed = False
        finally:
            self.watch.trackers.close()
            try:
                self.serving.stop()
            except Exception:
                if not failed:
                    raise
                log.exception("stopping the proxy after the run failed")  # the first error is the one told
        f.shutdown(reason)

    def watched(self) -> dict[str, Any]:
        """The step's fields the step kind does not know: where each cell's time went since the
        last step, and the weight loads."""
        w, f = self.watch, self.fleet
        loads = (w.loads.bytes - w.loads_seen[0], w.loads.seconds - w.loads_seen[1])
        w.loads_seen = (w.loads.bytes, w.loads.seconds)
        out: dict[str, Any] = {"weight_bytes": loads[0], "weight_seconds": round(loads[1], 4)}
        if w.hours is None:
            return out
        occupancy = self.serving.occupancy()
        busy = {
            u: sum(occupancy.get(a, 0.0) - w.occupancy.get(a, 0.0) for a in h.addresses)
            for u, h in f.units.items()
        }
        w.occupancy = occupancy
        split = w.hours.take(w.clock(), busy, {u: h.capacity for u, h in f.units.items()})
        since, w.since = w.since, time.time()
        return {**out, "cell_seconds": {str(c): t.as_dict() for c, t in split.items()}, "cell_since": since}

    def plot(self) -> None:
        try:
            events = self.run_dir.read_events()
            plot_run(events, self.run_dir.metrics_plot, self.run_dir.path.name)
            plot_cells(events, self.run_dir.cells_plot, self.run_dir.path.name)
        except Exception as err:  # a plot must never stop training
            log.warning("plot failed: %s", err)

    def on_run_event(self, kind: str, run_id: str) -> None:
        """d / p / f from the serving thread: the run's counters."""
        with self._lock:
            self.counters[kind] += 1
            d, p, f = (self.counters[k] for k in ("dispatched", "started", "finished"))
        if kind == "dispatched":
            self.events.emit(ev.Dispatched(run=run_id, d=d, p=p, f=f))
        elif kind == "finished":
            self.events.emit(ev.Finished(run=run_id, d=d, p=p, f=f))

    def evaluate(self, step: int) -> None:
        """Held-out tasks on the engines sampling now, with the version just published."""
        tasks = load_suite(self.tasks.suite, self.tasks.eval_n, seed=self.run_cfg.seed, split="heldout")
        jobs = [(eval_run_id(t.id, step), t) for t in tasks]
        outcomes = wait_for(self.fleet, self.serving.dispatch(jobs, self.run_dir.step_workspaces(step)))
        rewards = group_rewards(outcomes)
        event = ev.Eval(
            step=step,
            version=self.fleet.version,
            n=len(outcomes),
            statuses=dict(Counter(o.execution.status for o in outcomes)),
            pass_rate=pass_rate(rewards),
            mean_score=mean_reward(rewards),
        )
        self.watch.trackers.record(self.events.emit(event))


@dataclass(kw_only=True)
class Watch:
    """What the controller watches beside the steps: the trackers it feeds, the cells' books
    (kept by the fleet), the fleet's weight loads, and where the last step's window ended."""

    trackers: Trackers = field(default_factory=lambda: Trackers([]))
    hours: CellHours | None = None
    loads: Loads = field(default_factory=Loads)
    clock: Callable[[], float] = time.monotonic
    """The clock ``hours`` is marked on."""
    since: float = field(default_factory=time.time)
    occupancy: dict[str, float] = field(default_factory=dict)
    loads_seen: tuple[int, float] = (0, 0.0)


def cpu_seconds() -> float:
    """This process's CPU time, all threads, plus that of the children it has reaped."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime
