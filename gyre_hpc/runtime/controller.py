"""The controller (rank 0): brings the cells up and runs the RL step loop.

```
 start ─▶ Hello from every cell ─▶ proxy + harness up (serving thread) ─▶ initial roles
       ─▶ LoadWeights(v) everywhere (v = 0, or the resumed checkpoint's version)
       ─▶ ┌─ step k ─────────────────────────────────────────────────────────────────────┐
          │ prompts(k) × group ─▶ dispatch ─▶ harness ⇄ proxy ⇄ engines   (d / p / f)    │
          │ all finished ─▶ scores + TITO trees ─▶ select, weigh, pack micro-steps       │
          │ TrainStep to training cells ─▶ claim … ─▶ TrainDone ─▶ ApplyStep to the core │
          │ ─▶ StepApplied(v+1, checkpoint) ─▶ LoadWeights(v+1) on sampling engines      │
          └──────────────────────────────────────────────────────────────────────────────┘
       ─▶ Shutdown ─▶ barrier
```

colocate: every cell samples until the step's last execution ends, then every cell trains.
elastic: cells move to training one by one while the burst still runs (``runtime.elastic``).
async: a fixed split — the first ``async_train_cells`` cells (core first) only train, the
others only sample; step k+1 is dispatched as soon as step k's executions end, so sampling
never waits for training and the data is at most one version stale (recorded per call).

The controller talks to cells only through ``Channel``, to the harness and proxy only through
``Serving``, and records what happens only through the event log.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gyre_hpc.agents.dispatch import Outcome
from gyre_hpc.observability.events import EventLog
from gyre_hpc.observability.plot import plot_run
from gyre_hpc.recipe.schema import (
    CellsConfig,
    RunConfig,
    SchedulerConfig,
    TasksConfig,
    TrainerConfig,
    TrajectoryConfig,
)
from gyre_hpc.runtime.elastic import ElasticStep
from gyre_hpc.runtime.protocol import (
    POLL_INTERVAL_S,
    ApplyStep,
    Channel,
    Heartbeat,
    Hello,
    LoadWeights,
    Message,
    ProtocolError,
    Role,
    RoleSwitched,
    Shutdown,
    StepApplied,
    SwitchRole,
    TrainDone,
    TrainStep,
    WeightsLoaded,
    wait_barrier,
)
from gyre_hpc.runtime.serving import Serving
from gyre_hpc.runtime.step_data import step_batch, step_jobs, step_tasks
from gyre_hpc.runtime.world import World
from gyre_hpc.scheduler.policy import initial_roles
from gyre_hpc.tasks.suites import load_suite
from gyre_hpc.transport.base import Transport

log = logging.getLogger(__name__)


class CellLost(RuntimeError):
    """A cell stopped reporting."""


class Controller:
    def __init__(
        self,
        world: World,
        run: RunConfig,
        cells: CellsConfig,
        scheduler: SchedulerConfig,
        tasks: TasksConfig,
        trajectory: TrajectoryConfig,
        trainer: TrainerConfig,
        events: EventLog,
        run_dir: Path,
        transport: Transport,
        make_serving: Any,
        resume: dict[str, Any] | None = None,
    ) -> None:
        self.world, self.run_cfg, self.cells, self.scheduler = world, run, cells, scheduler
        self.tasks, self.trajectory, self.trainer_cfg = tasks, trajectory, trainer
        self.events, self.run_dir, self.transport = events, run_dir, transport
        self.make_serving = make_serving
        self.resume = resume or {}
        self.channel = Channel(world.comm)
        self.hellos: dict[int, Hello] = {}
        self.roles: dict[int, Role] = {}
        self.last_seen: dict[int, float] = {}
        self._seq = 0
        self._lock = threading.Lock()
        self.counters = Counter[str]()
        self.version = int(self.resume.get("version", 0))

    # ---- the run ----------------------------------------------------------------------------

    def run(self) -> None:
        layout = self.world.layout
        self.events.emit(
            "world_up",
            size=layout.world_size,
            layout=layout.describe(),
            launcher=self.world.env.launcher,
            job_id=self.world.env.job_id,
            transport=self.transport.name,
        )
        self.gather_hellos()
        self.serving: Serving = self.make_serving(
            [self.hellos[u].address for u in range(layout.units)], self.on_run_event
        )
        self.events.emit("proxy_up", url=self.serving.start())
        try:
            roles = initial_roles(self.scheduler.mode, layout.cells, self.scheduler.async_train_cells)
            roles += [Role.SAMPLING] * layout.pool  # standalone engines only ever sample
            self.switch(dict(enumerate(roles)))
            self.load_weights(self.version, list(range(layout.units)))
            first = int(self.resume.get("step", 0)) + 1
            if first > 1:
                self.events.emit("resumed", step=first, version=self.version)
            if self.scheduler.mode == "colocate":
                self.run_colocate(first)
            elif self.scheduler.mode == "async":
                self.run_async(first)
            else:
                carried: list = []
                for step in range(first, self.run_cfg.steps + 1):
                    carried = ElasticStep(self, step, carried).run()
        finally:
            self.serving.stop()
        self.shutdown("completed")

    def run_colocate(self, first: int) -> None:
        units = list(range(self.world.layout.units))
        urls = {h.address for h in self.hellos.values()}
        for step in range(first, self.run_cfg.steps + 1):
            started = time.monotonic()
            self.switch(dict.fromkeys(units, Role.SAMPLING))
            self.serving.set_sampling(urls)
            outcomes = self.wait(self.dispatch(step))
            tito_bytes = self.serving.tito_bytes()
            sampled = time.monotonic()
            self.serving.set_sampling(set())
            self.switch(dict.fromkeys(range(self.world.layout.cells), Role.TRAINING))
            train = self.train_step(step, outcomes, list(range(self.world.layout.cells)), tito_bytes)
            self.load_weights(self.version, units)
            self.finish_step(step, started, sampled, train)

    def run_async(self, first: int) -> None:
        layout = self.world.layout
        trainers = [c for c in range(layout.cells) if self.roles[c] == Role.TRAINING]
        samplers = [u for u in range(layout.units) if u not in trainers]
        self.serving.set_sampling({self.hellos[u].address for u in samplers})
        pending = self.dispatch(first)
        for step in range(first, self.run_cfg.steps + 1):
            started = time.monotonic()
            outcomes = self.wait(pending)
            tito_bytes = self.serving.tito_bytes()
            sampled = time.monotonic()
            if step < self.run_cfg.steps:
                pending = self.dispatch(step + 1)  # sampling never waits for training
            train = self.train_step(step, outcomes, trainers, tito_bytes)
            self.load_weights(self.version, samplers)
            self.finish_step(step, started, sampled, train)

    # ---- sampling ---------------------------------------------------------------------------

    def dispatch(
        self,
        step: int,
        heldout: bool = False,
        on_outcome: Callable[[Outcome], None] = lambda outcome: None,
    ) -> concurrent.futures.Future[list[Outcome]]:
        if heldout:
            tasks = load_suite(self.tasks.suite, self.tasks.eval_n, seed=self.run_cfg.seed, split="heldout")
            jobs = [(f"eval{step:04d}-{t.id}", t) for t in tasks]
        else:
            jobs = step_jobs(step_tasks(self.tasks, self.run_cfg.seed, step), self.tasks.group_size, step)
        return self.serving.dispatch(jobs, self.run_dir / "workspaces" / f"step-{step:04d}", on_outcome)

    def on_run_event(self, kind: str, run_id: str) -> None:
        """d / p / f from the serving thread: the scheduler's counters."""
        with self._lock:
            self.counters[kind] += 1
            d, p, f = (self.counters[k] for k in ("dispatched", "started", "finished"))
        if kind != "started":
            self.events.emit(kind, run=run_id, d=d, p=p, f=f)

    def wait(self, future: concurrent.futures.Future[Any]) -> Any:
        """The future's result, booking heartbeats (and catching a silent cell) meanwhile."""
        while not future.done():
            self.check_alive(time.monotonic())
            got = self.channel.poll()
            if got is None:
                time.sleep(0.01)
            elif not isinstance(got[1], Heartbeat):
                raise ProtocolError(f"controller: unexpected {got[1]!r} while sampling")
            else:
                self.last_seen[got[1].cell] = time.monotonic()
        return future.result()

    # ---- training ---------------------------------------------------------------------------

    def train_step(
        self, step: int, outcomes: list[Outcome], cells: list[int], tito_bytes: int
    ) -> dict[str, Any]:
        runs = [o.execution.run_id for o in outcomes]
        trees = self.serving.trees(runs)
        batch = step_batch(
            outcomes, trees, self.trajectory, self.trainer_cfg.micro_step_tokens, self.run_cfg.seed, step
        )
        stale = Counter(
            self.version - r.policy_version for run in runs if run in trees for r in trees[run].records()
        )
        info: dict[str, Any] = {**batch.stats, "staleness": {str(k): v for k, v in sorted(stale.items())}}
        done: dict[int, TrainDone] = {}
        deadline = time.monotonic() + self.cells.heartbeat_timeout_s * max(len(batch.queue), 1)
        if batch.queue:
            self.transport.reset_counter()
            for c in cells:
                self.channel.send(TrainStep(step, self.version, batch.queue), self.world.layout.leader(c))
            while len(done) < len(cells):
                _, msg = self.receive(deadline, "TrainDone")
                if isinstance(msg, TrainDone) and msg.step == step:
                    done[msg.cell] = msg
        else:  # every group had equal rewards: no gradient, no new version (still a checkpoint)
            info["skipped"] = True
        msg = self.apply_step(step, done, batch.num_runs if batch.queue else 0, tito_bytes, deadline)
        self.version = msg.version
        info.update(
            loss=sum(d.loss_sum for d in done.values()) / max(batch.num_runs, 1),
            grad_norm=round(msg.grad_norm, 6),
            clipped_tokens=sum(d.clipped for d in done.values()),
            claims={str(c): len(d.claimed) for c, d in sorted(done.items())},
            train_seconds=round(max((d.seconds for d in done.values()), default=0.0), 3),
            apply_seconds=round(msg.seconds, 3),
            checkpoint=msg.checkpoint,
        )
        return info

    def writes_checkpoint(self, step: int) -> bool:
        every = self.trainer_cfg.checkpoint_every
        return bool(every) and (step % every == 0 or step == self.run_cfg.steps)

    def apply_step(
        self, step: int, done: dict[int, TrainDone], num_runs: int, tito_bytes: int, deadline: float
    ) -> StepApplied:
        """The core sums the trainers' gradients, steps (unless ``num_runs`` is 0) and checkpoints."""
        save = self.writes_checkpoint(step)
        contributors = [self.world.layout.leader(c) for c, d in done.items() if c != 0 and d.claimed]
        self.channel.send(
            ApplyStep(step, contributors, num_runs, save, {"tito_bytes": tito_bytes}),
            self.world.layout.leader(0),
        )
        while True:
            _, msg = self.receive(deadline, "StepApplied")
            if isinstance(msg, StepApplied) and msg.step == step:
                return msg

    def finish_step(self, step: int, started: float, sampled: float, info: dict[str, Any]) -> None:
        now = time.monotonic()
        self.events.emit(
            "step",
            step=step,
            version=self.version,
            seconds=round(now - started, 3),
            sample_seconds=round(sampled - started, 3),
            roles={c: str(r) for c, r in self.roles.items()},
            **info,
        )
        if self.tasks.eval_every and step % self.tasks.eval_every == 0:
            if self.scheduler.mode == "colocate":  # the cells are training: sample again first
                self.switch(dict.fromkeys(range(self.world.layout.units), Role.SAMPLING))
                self.serving.set_sampling({h.address for h in self.hellos.values()})
            outcomes = self.wait(self.dispatch(step, heldout=True))
            rewards = [o.score.reward or 0.0 for o in outcomes if o.score.counts_in_group]
            self.events.emit(
                "eval",
                step=step,
                version=self.version,
                n=len(outcomes),
                statuses=dict(Counter(o.execution.status for o in outcomes)),
                pass_rate=sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
                mean_score=sum(rewards) / max(len(rewards), 1),
            )
        try:
            plot_run(self.run_dir)
        except Exception as err:  # a plot must never stop training
            log.warning("plot failed: %s", err)

    # ---- cells ------------------------------------------------------------------------------

    def gather_hellos(self) -> None:
        deadline = time.monotonic() + self.cells.hello_timeout_s
        while len(self.hellos) < self.world.layout.units:
            missing = sorted(set(range(self.world.layout.units)) - set(self.hellos))
            _, msg = self.receive(deadline, f"Hello from cells {missing}")
            if isinstance(msg, Hello):
                self.hellos[msg.cell] = msg
                self.roles[msg.cell] = Role.IDLE
                self.last_seen[msg.cell] = time.monotonic()
                self.events.emit(
                    "hello",
                    cell=msg.cell,
                    rank=msg.rank,
                    host=msg.host,
                    pid=msg.pid,
                    address=msg.address,
                    capacity=msg.capacity,
                    standalone=msg.standalone,
                )

    def switch(self, roles: dict[int, Role]) -> None:
        """Send every SwitchRole that changes something, then wait for all acknowledgements."""
        pending: dict[int, int] = {}
        for cell, role in roles.items():
            if self.roles.get(cell) == role:
                continue
            self._seq += 1
            pending[cell] = self._seq
            self.channel.send(SwitchRole(cell, role, self._seq), self.world.layout.leader(cell))
            self.events.emit("switch_role", cell=cell, role=str(role), seq=self._seq)
        deadline = time.monotonic() + self.cells.heartbeat_timeout_s
        while pending:
            _, msg = self.receive(deadline, f"RoleSwitched from cells {sorted(pending)}")
            if isinstance(msg, RoleSwitched) and pending.get(msg.cell) == msg.seq:
                del pending[msg.cell]
                self.roles[msg.cell] = msg.role
                self.events.emit(
                    "role_switched",
                    cell=msg.cell,
                    role=str(msg.role),
                    seq=msg.seq,
                    seconds=round(msg.seconds, 6),
                )

    def load_weights(self, version: int, units: list[int]) -> None:
        """Every listed engine pulls snapshot ``version``; returns once all have it."""
        if not units:
            return
        for unit in units:
            self.channel.send(LoadWeights(unit, version), self.world.layout.leader(unit))
        pending = set(units)
        deadline = time.monotonic() + self.cells.heartbeat_timeout_s
        seconds = []
        while pending:
            _, msg = self.receive(deadline, f"WeightsLoaded from {sorted(pending)}")
            if isinstance(msg, WeightsLoaded) and msg.version == version:
                pending.discard(msg.cell)
                seconds.append(msg.seconds)
        self.events.emit("weights_loaded", version=version, units=units, seconds=round(max(seconds), 4))

    def shutdown(self, reason: str) -> None:
        for unit in range(self.world.layout.units):
            self.channel.send(Shutdown(reason), self.world.layout.leader(unit))
        self.events.emit("shutdown", reason=reason)
        self.channel.flush(self.cells.heartbeat_timeout_s)
        wait_barrier(self.world.comm, self.cells.heartbeat_timeout_s)

    def receive(self, deadline: float, what: str) -> tuple[int, Message]:
        """The next non-heartbeat message; heartbeats are booked, a silent cell raises CellLost."""
        while True:
            now = time.monotonic()
            self.check_alive(now)
            got = self.channel.poll()
            if got is not None:
                if isinstance(got[1], Heartbeat):
                    self.last_seen[got[1].cell] = now
                    continue
                return got
            if now > deadline:
                raise ProtocolError(f"controller: no {what} in time")
            time.sleep(POLL_INTERVAL_S)

    def check_alive(self, now: float) -> None:
        for cell, seen in self.last_seen.items():
            if now - seen > self.cells.heartbeat_timeout_s:
                hello = self.hellos[cell]
                raise CellLost(
                    f"cell {cell} (rank {hello.rank} on {hello.host}) silent for {now - seen:.0f} s"
                )
