"""The controller (rank 0): brings the cells up and runs the RL step loop.

```
 start ─▶ Hello from every cell (fleet.start) ─▶ proxy + harness up (serving thread)
       ─▶ initial roles (policy) ─▶ every engine loads v (0, or the resumed checkpoint's version)
       ─▶ ┌─ step k: the step kind of scheduler.mode (scheduler.steps)────────────────────────┐
          │ dispatch ─▶ harness ⇄ proxy ⇄ engines (d / p / f) ─▶ trajectory trees ─▶ micro-steps │
          │ cells the policy sends train them ─▶ the core applies v+1 (checkpoint when due)       │
          │ ─▶ boundary: engines load v+1, trainers return as the policy says                     │
          └─▶ step event ─▶ held-out evaluation (tasks.eval_every) ─▶ metrics.png ───────────────┘
       ─▶ Shutdown ─▶ barrier                (SIGUSR2: the step under way checkpoints, then this)
```

The controller owns the run loop only: which step kind runs a step, what is recorded after it,
evaluations and the plot. It talks to cells only through its ``Fleet``, to executions only
through ``Serving``, and records what happens only through the event log.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from gyre_hpc.data_order import DataOrder
from gyre_hpc.observability import events as ev
from gyre_hpc.observability.plot import plot_run
from gyre_hpc.recipe.schema import RunConfig, SchedulerConfig, TasksConfig, TrainerConfig, TrajectoryConfig
from gyre_hpc.rundir import RunDir
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
from gyre_hpc.tasks.suites import load_suite

log = logging.getLogger(__name__)

MakeServing = Callable[[dict[str, int], Callable[[str, str], None]], Serving]


class Controller:
    def __init__(
        self,
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
    ) -> None:
        self.fleet, self.make_serving, self.events, self.run_dir = fleet, make_serving, events, run_dir
        self.run_cfg, self.scheduler, self.tasks = run, scheduler, tasks
        self.trajectory, self.trainer = trajectory, trainer
        self.first_step = first_step
        self.checkpoint_now = checkpoint_now or threading.Event()
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
                f, self.serving, self.events, self.run_dir, data, self.run_cfg,
                self.scheduler, self.tasks, self.trajectory, self.trainer,
                checkpoint_now=self.checkpoint_now,
            )  # fmt: skip
            kind = step_kind(self.scheduler)(ctx)
            for step in range(self.first_step, self.run_cfg.steps + 1):
                cpu = cpu_seconds()
                record = kind.run(step)
                event = step_event(record, ctx.clock(), f.roles)
                self.events.emit(replace(event, controller_cpu_s=round(cpu_seconds() - cpu, 3)))
                if self.tasks.eval_every and step % self.tasks.eval_every == 0:
                    self.evaluate(step)
                try:
                    plot_run(self.run_dir.read_events(), self.run_dir.metrics_plot, self.run_dir.path.name)
                except Exception as err:  # a plot must never stop training
                    log.warning("plot failed: %s", err)
                if self.checkpoint_now.is_set() and record.applied.checkpoint and step < self.run_cfg.steps:
                    self.events.emit(ev.Preempted(step=step, checkpoint=record.applied.checkpoint))
                    self.run_dir.request_requeue(step)
                    reason = "preempted"
                    break
            failed = False
        finally:
            try:
                self.serving.stop()
            except Exception:
                if not failed:
                    raise
                log.exception("stopping the proxy after the run failed")  # the first error is the one told
        f.shutdown(reason)

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
        jobs = [(f"eval{step:04d}-{t.id}", t) for t in tasks]
        outcomes = wait_for(self.fleet, self.serving.dispatch(jobs, self.run_dir.step_workspaces(step)))
        rewards = [o.score.reward or 0.0 for o in outcomes if o.score.counts_in_group]
        self.events.emit(
            ev.Eval(
                step=step,
                version=self.fleet.version,
                n=len(outcomes),
                statuses=dict(Counter(o.execution.status for o in outcomes)),
                pass_rate=sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
                mean_score=sum(rewards) / max(len(rewards), 1),
            )
        )


def cpu_seconds() -> float:
    """This process's CPU time, all threads, plus that of the children it has reaped."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime
