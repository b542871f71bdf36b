"""The step kinds: one optimizer step each, carried out through the fleet as the policy says.

```
 a cell, as a step kind moves it (every switch one the policy returned):
   SAMPLING ──drain its calls, switch, TrainStep(queue so far)──▶ TRAINING ── claims micro-steps
      ▲                                                              │        until the queue
      └── boundary: switch back, load v+1, admit calls at v+1 ◀──────┘        closes: TrainDone

          colocate            async                elastic               in-flight (k > 0)
 dispatch burst k, every      burst k+1 once       burst k, every        k's prompts not sent
          cell sampling       burst k ended        cell sampling         ahead + a look-ahead
                                                                         share of k+1's
 sample   wait for the        (never waits for     a group ends →        the same; ends after
          whole burst         training)            its micro-steps       the close wait for k+1
 train    decide: all         the fixed split      decide each poll:     the same; at the quota
          cells train         trains k             next cell joins;      stale runs stopped,
                                                   burst over: close     then the queue closes
 apply    the core sums the cells' gradients, steps, publishes v+1 (checkpoint when due)
 close    decide: all back,   samplers load v+1    decide: back one by one, last first
          load v+1
```

Every role switch is one the policy (``scheduler.policy.decide``) returned for the state built by
``sched_state`` from the step's counters; the step-boundary rules are the policy module's, the
in-flight rules ``scheduler.inflight``'s. A step kind talks to cells only through its ``Fleet``
and to executions only through its ``Sampler``, so it runs unchanged against the MPI fleet and
against an in-process fake. It knows nothing about MPI, HTTP, models or files beyond the run
directory's TITO size.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gyre_hpc.execution.outcome import Outcome
from gyre_hpc.loss.token_stats import TokenStats
from gyre_hpc.observability import events as ev
from gyre_hpc.observability.events import Hello
from gyre_hpc.plan.placement import replica_capacity
from gyre_hpc.recipe.schema import RunConfig, SchedulerConfig, TasksConfig, TrainerConfig, TrajectoryConfig
from gyre_hpc.scheduler.fleet import Fleet, ProtocolError, StepApplied, TrainDone
from gyre_hpc.scheduler.inflight import closes, in_flight, lookahead, to_stop
from gyre_hpc.scheduler.policy import (
    Role,
    RoleChange,
    SchedState,
    StepCounters,
    carries_tail,
    decide,
    sched_state,
    writes_checkpoint,
)
from gyre_hpc.step.batch import StepBatch, StreamingBatch, step_batch
from gyre_hpc.step.stats import staleness, token_staleness
from gyre_hpc.trajectory.sequences import TrainSequence
from gyre_hpc.trajectory.tree import TrajectoryTree

T = TypeVar("T")


class Jobs(Protocol):
    """The run's data order (``data_order.DataOrder``): each step's executions, as (run id, task)."""

    def jobs(self, step: int, prompts: int | None = None) -> list[tuple[str, Any]]:
        """The executions of ``step``'s first ``prompts`` prompts (all of them when None)."""


class StepFiles(Protocol):
    """The run directory's part a step kind touches (``rundir.RunDir``)."""

    def step_workspaces(self, step: int) -> Path: ...

    def journal(self, step: int) -> Path: ...

    def tito_bytes(self) -> dict[str, int]:
        """Each TITO log segment's size: what a checkpoint of this step keeps."""


class Sampler(Protocol):
    """Executions through the proxy (``runtime.serving.Serving``, or a fake in tests)."""

    def dispatch(
        self,
        jobs: list[tuple[str, Any]],
        workspaces: Path,
        on_outcome: Callable[[Outcome], None],
        journal: Path | None = None,
    ) -> concurrent.futures.Future[list[Outcome]]:
        """Run ``jobs``; with a ``journal`` directory, executions a previous attempt journalled
        there continue (or, finished, are returned as they were)."""

    def trees(self, run_ids: list[str]) -> dict[str, TrajectoryTree]: ...

    def set_sampling(self, urls: set[str]) -> None:
        """Admit new calls only on these engines; drain the others (their calls move)."""

    def hold(self, urls: set[str]) -> None:
        """Before a load into these engines: no new call, and their calls stop where they are
        (each goes on from its partial output once a version is loaded)."""

    def loaded(self, urls: set[str], version: int) -> None:
        """These engines hold ``version`` now: admit calls to them at it."""

    def stop_runs(self, run_ids: list[str]) -> None:
        """End these executions now; each is scored on what it left."""


def engine_urls(fleet: Fleet, units: Sequence[int]) -> set[str]:
    """The URLs of every engine replica of these units."""
    return {a for u in units for a in fleet.units[u].addresses}


def engine_limits(hellos: dict[int, Hello]) -> dict[str, int]:
    """Calls in flight each engine admits, in unit then replica order: its cell's capacity
    shared by the cell's replicas."""
    return {
        a: replica_capacity(h.capacity, len(h.addresses))
        for _, h in sorted(hellos.items())
        for a in h.addresses
    }


def load_serving(fleet: Fleet, sampler: Sampler, units: Sequence[int]) -> float:
    """The current version into these units' engines, which the router admits again only at it:
    calls running there stop first and go on from their partial output once it is loaded (so
    each part of a call is tagged with the version that generated it). The slowest load's s."""
    urls = engine_urls(fleet, units)
    sampler.hold(urls)
    seconds = fleet.load_weights(list(units))
    sampler.loaded(urls, fleet.version)
    return seconds


@dataclass
class StepContext:
    """What a step kind works with: its collaborators and the config sections it reads."""

    fleet: Fleet
    sampler: Sampler
    events: ev.EventLog
    run_dir: StepFiles
    data: Jobs
    run: RunConfig
    scheduler: SchedulerConfig
    tasks: TasksConfig
    trajectory: TrajectoryConfig
    trainer: TrainerConfig
    clock: Callable[[], float] = time.monotonic
    checkpoint_now: threading.Event = field(default_factory=threading.Event)
    """Set (by SIGUSR2) to checkpoint the step under way and stop after it."""


@dataclass
class StepRecord:
    """What one step did, whatever its kind; ``step_event`` turns it into the ``step`` event."""

    step: int
    started: float
    sampled: float
    """When its burst ended."""
    stats: dict[str, Any]
    """``step_stats.step_stats`` of its batch."""
    loss_runs: int
    """The runs the loss is averaged over."""
    done: dict[int, TrainDone]
    applied: StepApplied
    skipped: bool
    staleness: dict[str, int]
    switches: list[dict[str, Any]]
    staleness_tokens: dict[str, int] = field(default_factory=dict)
    carried_in: int = 0
    carried_out: int = 0
    train_before_burst_end_s: float | None = None


def step_event(r: StepRecord, now: float, roles: dict[int, Role]) -> ev.Step:
    """The one builder of the ``step`` event, for every mode."""
    done = r.done.values()
    return ev.Step(
        step=r.step,
        version=r.applied.version,
        seconds=round(now - r.started, 3),
        sample_seconds=round(r.sampled - r.started, 3),
        roles={str(c): str(role) for c, role in sorted(roles.items())},
        **r.stats,
        forwarded_tokens=sum(d.tokens for d in done),  # as each trainer forwarded it (forest or trees)
        staleness=r.staleness,
        staleness_tokens=r.staleness_tokens,
        loss=sum(d.loss_sum for d in done) / max(r.loss_runs, 1),
        grad_norm=round(r.applied.grad_norm, 6),
        clipped_tokens=sum(d.stats.clipped for d in done),
        token_stats=sum((d.stats for d in done), TokenStats()).summary(),
        claims={str(c): len(d.claimed) for c, d in sorted(r.done.items())},
        train_seconds=round(max((d.seconds for d in done), default=0.0), 3),
        apply_seconds=round(r.applied.seconds, 3),
        checkpoint=r.applied.checkpoint,
        skipped=r.skipped,
        carried_in=r.carried_in,
        carried_out=r.carried_out,
        train_before_burst_end_s=r.train_before_burst_end_s,
        switches=r.switches,
    )


def wait_for(fleet: Fleet, future: concurrent.futures.Future[T]) -> T:
    """The future's result; meanwhile the fleet books heartbeats (no cell trains while we wait)."""
    while not future.done():
        if (msg := fleet.receive()) is not None:
            raise ProtocolError(f"controller: unexpected {msg!r} while sampling")
    return future.result()


class StepKind:
    """What every step kind shares: dispatch, the policy's view, switches both ways, training a
    queue out, applying, and the step boundary."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.switches: list[dict[str, Any]] = []

    def run(self, step: int) -> StepRecord:
        raise NotImplementedError

    # ---- sampling -------------------------------------------------------------------------------

    def dispatch(
        self, step: int, on_outcome: Callable[[Outcome], None] = lambda o: None
    ) -> concurrent.futures.Future[list[Outcome]]:
        c = self.ctx
        jobs = c.data.jobs(step)
        return c.sampler.dispatch(jobs, c.run_dir.step_workspaces(step), on_outcome, c.run_dir.journal(step))

    def batch(self, step: int, outcomes: list[Outcome]) -> StepBatch:
        """The whole step's batch at once (colocate, async)."""
        c = self.ctx
        trees = c.sampler.trees([o.execution.run_id for o in outcomes])
        return step_batch(outcomes, trees, c.trajectory, c.trainer.micro_step_tokens, c.run.seed, step)

    def sampling_urls(self, leaving: Sequence[int] = ()) -> set[str]:
        f = self.ctx.fleet
        return engine_urls(f, [u for u, r in f.roles.items() if r == Role.SAMPLING and u not in leaving])

    # ---- the policy -----------------------------------------------------------------------------

    def state(self, counters: StepCounters) -> SchedState:
        f = self.ctx.fleet
        cells = range(f.cells)
        pool = sum(h.capacity for u, h in f.units.items() if u >= f.cells)
        capacity = [f.units[c].capacity for c in cells]
        return sched_state(self.ctx.scheduler, [f.roles[c] for c in cells], capacity, pool, counters)

    def to_training(
        self, step: int, switches: list[RoleChange], queue: list, closed: bool, water: int
    ) -> list[int]:
        """Drain the cells (their calls continue elsewhere), switch them, hand them the queue."""
        c, f = self.ctx, self.ctx.fleet
        cells = [s.cell for s in switches]
        t0 = c.clock()
        c.sampler.set_sampling(self.sampling_urls(leaving=cells))
        t1 = c.clock()
        f.switch(dict.fromkeys(cells, Role.TRAINING))
        t2 = c.clock()
        f.train(cells, step, queue, closed)
        for s in switches:
            self.record(step, s, "sampling→training", drain_s=t1 - t0, switch_s=t2 - t1, w=water)
        return cells

    def to_sampling(self, step: int, switches: list[RoleChange]) -> None:
        """Switch the cells back, load the current version into their engines, admit calls."""
        c, f = self.ctx, self.ctx.fleet
        cells = [s.cell for s in switches]
        t0 = c.clock()
        f.switch(dict.fromkeys(cells, Role.SAMPLING))
        t1 = c.clock()
        load_serving(f, c.sampler, cells)
        t2 = c.clock()
        c.sampler.set_sampling(self.sampling_urls())
        for s in switches:
            self.record(
                step, s, "training→sampling", switch_s=t1 - t0, load_s=t2 - t1, admit_s=c.clock() - t2
            )

    def record(self, step: int, s: RoleChange, direction: str, w: int | None = None, **phases: float) -> None:
        event = ev.Switch(
            step=step,
            cell=s.cell,
            direction=direction,
            reason=s.reason,
            seconds=round(sum(phases.values()), 4),
            w=w,
            **{k: round(v, 4) for k, v in phases.items()},
        )
        self.ctx.events.emit(event)
        self.switches.append(event.fields())

    # ---- training -------------------------------------------------------------------------------

    def train_queue(self, step: int, queue: list, counters: StepCounters) -> dict[int, TrainDone]:
        """A complete queue (colocate, async): the cells already training and those the policy
        sends now claim it until it is empty."""
        if not queue:
            return {}
        f = self.ctx.fleet
        f.reset_claims()
        trainers = [c for c in range(f.cells) if f.roles[c] == Role.TRAINING]
        f.train(trainers, step, queue, closed=True)
        joining = [s for s in decide(self.state(counters)) if s.role == Role.TRAINING]
        if joining:
            trainers += self.to_training(step, joining, queue, True, counters.dispatched - counters.finished)
        return self.await_done(step, trainers)

    def await_done(self, step: int, trainers: list[int]) -> dict[int, TrainDone]:
        done: dict[int, TrainDone] = {}
        while set(done) != set(trainers):
            if (msg := self.ctx.fleet.receive()) is not None and msg.step == step:
                done[msg.cell] = msg
        return done

    def apply(
        self, step: int, done: dict[int, TrainDone], num_runs: int, tito_bytes: dict[str, int]
    ) -> StepApplied:
        c = self.ctx
        return c.fleet.apply(step, done, num_runs, self.checkpoint_due(step), {"tito_bytes": tito_bytes})

    def checkpoint_due(self, step: int) -> bool:
        """The recipe's schedule, or now: a checkpoint was asked for (SIGUSR2, a time limit near)."""
        c = self.ctx
        return writes_checkpoint(step, c.trainer.checkpoint_every, c.run.steps) or c.checkpoint_now.is_set()

    def close(self, step: int, counters: StepCounters) -> None:
        """The step boundary: sampling engines load the new version, then the policy sends the
        training cells back (boundary rule 3)."""
        f = self.ctx.fleet
        load_serving(f, self.ctx.sampler, [u for u, r in sorted(f.roles.items()) if r == Role.SAMPLING])
        while switches := decide(self.state(counters.closed())):
            if any(s.role != Role.SAMPLING for s in switches):
                raise ProtocolError(f"the policy sent cells to training between steps: {switches}")
            self.to_sampling(step, switches)

    def begin(self, step: int) -> float:
        self.switches = []
        return self.ctx.clock()

    def burst_ended(self) -> tuple[float, dict[str, int]]:
        """When the step's burst ended, and how long the TITO log was then: a checkpoint of this
        step keeps the log up to there (a resumed run samples everything after it again)."""
        return self.ctx.clock(), self.ctx.run_dir.tito_bytes()

    def train_burst(
        self, step: int, started: float, outcomes: list[Outcome], ended: tuple[float, int]
    ) -> StepRecord:
        """A burst that has ended, as one batch (colocate, async): the policy's trainers train
        it out, the core applies it, and the step closes."""
        c = self.ctx
        sampled, tito_bytes = ended
        batch = self.batch(step, outcomes)
        n = len(outcomes)
        counters = StepCounters(dispatched=n, finished=n, packed=len(batch.queue), open=True)
        trained_from = c.fleet.version
        done = self.train_queue(step, batch.queue, counters)
        runs = batch.num_runs if batch.queue else 0
        applied = self.apply(step, done, runs, tito_bytes)
        self.close(step, counters)
        return StepRecord(
            step, started, sampled, batch.stats, batch.num_runs, done, applied, runs == 0,
            staleness(batch.trees.values(), trained_from), self.switches,
            token_staleness(batch.queue, trained_from),
        )  # fmt: skip


class ColocateStep(StepKind):
    """Every cell samples until the burst's last execution ends, then every cell trains."""

    def run(self, step: int) -> StepRecord:
        started = self.begin(step)
        outcomes = wait_for(self.ctx.fleet, self.dispatch(step))
        return self.train_burst(step, started, outcomes, self.burst_ended())


class AsyncStep(StepKind):
    """A fixed split: burst k+1 samples while step k trains, so data is at most one version stale."""

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self.pending: concurrent.futures.Future[list[Outcome]] | None = None

    def run(self, step: int) -> StepRecord:
        started = self.begin(step)
        outcomes = wait_for(self.ctx.fleet, self.pending or self.dispatch(step))
        ended = self.burst_ended()  # before the next burst's calls reach the log
        last = step == self.ctx.run.steps
        self.pending = None if last else self.dispatch(step + 1)  # sampling never waits for training
        return self.train_burst(step, started, outcomes, ended)


@dataclass
class _Burst:
    """The elastic step's counters and trainers while it runs."""

    dispatched: int
    finished: int = 0
    trainers: dict[int, float] = field(default_factory=dict)
    """Cell → when it joined."""
    done: dict[int, TrainDone] = field(default_factory=dict)
    closed_at: float | None = None
    stopped: bool = False

    def trained(self, queue: list) -> bool:
        """The burst has ended and every cell that joined has trained out the queue (an empty
        queue needs no trainer; a non-empty one needs at least one)."""
        if self.closed_at is None or set(self.done) != set(self.trainers):
            return False
        return bool(self.trainers) or not queue


class StreamingStep(StepKind):
    """What elastic and in-flight share: each prompt group becomes micro-steps as soon as its
    last run ends, cells join the step one by one (the water-level rule), and the step is
    applied once the trainers have trained the closed queue out."""

    def finish(
        self,
        step: int,
        started: float,
        b: _Burst,
        batch: StreamingBatch,
        runs: int,
        trained_from: int,
        trained: list[list[TrainSequence]],
        **carry: int,
    ) -> StepRecord:
        """Apply what the cells trained (``trained``: those micro-steps), close the step, and
        record it."""
        _, tito_bytes = self.burst_ended()
        applied = self.apply(step, b.done, runs, tito_bytes)
        self.close(step, self.counters(b, len(batch.queue)))
        early = b.closed_at - min(b.trainers.values()) if b.trainers and b.closed_at else None
        return StepRecord(
            step, started, b.closed_at or self.ctx.clock(), batch.stats(), batch.num_runs, b.done,
            applied, runs == 0, staleness(batch.trees.values(), trained_from), self.switches,
            token_staleness(trained, trained_from), **carry,
            train_before_burst_end_s=None if early is None else round(max(early, 0.0), 3),
        )  # fmt: skip

    def add(self, step: int, b: _Burst, batch: StreamingBatch, outcome: Outcome) -> None:
        """Book one ended execution; the micro-steps its group completed go to the trainers."""
        run = outcome.execution.run_id
        if new := batch.add(outcome, self.ctx.sampler.trees([run]).get(run)):
            self.ctx.fleet.extend(list(b.trainers), step, new)

    def advance(self, step: int, b: _Burst, queue: list) -> bool:
        """One turn: the cells the policy sends join the step, one TrainDone is booked; True once
        the queue is trained out."""
        for s in decide(self.state(self.counters(b, len(queue)))):
            self.to_training(step, [s], queue, b.closed_at is not None, b.dispatched - b.finished)
            b.trainers[s.cell] = self.ctx.clock()
        if b.trained(queue):
            return True
        if (msg := self.ctx.fleet.receive()) is not None and msg.step == step:
            b.done[msg.cell] = msg
        return False

    def counters(self, b: _Burst, packed: int) -> StepCounters:
        return StepCounters(b.dispatched, b.finished, packed, self.ctx.fleet.claimed(), True, b.stopped)

    def close_burst(self, step: int, b: _Burst, total: int, stop: bool) -> None:
        """The queue is complete: no micro-step joins it any more."""
        c, f = self.ctx, self.ctx.fleet
        b.closed_at = c.clock()
        b.stopped = stop
        f.close_queue(list(b.trainers), step, total, b.stopped)
        c.events.emit(ev.BurstEnd(step=step, micro_steps=total, trainers=sorted(b.trainers), stop=b.stopped))


class ElasticStep(StreamingStep):
    """Cells move to training one by one while the burst still runs; the queue closes when the
    burst's last execution ends (with ``carry_tail``, the step may then stop and leave the rest
    of its queue to the next one)."""

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self.carried: list[list[TrainSequence]] = []
        """``carry_tail``: micro-steps the previous step left; they lead this step's queue."""

    def run(self, step: int) -> StepRecord:
        c, f = self.ctx, self.ctx.fleet
        started = self.begin(step)
        f.reset_claims()  # nobody claims between steps
        arrived: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        future = self.dispatch(step, on_outcome=arrived.put)
        t = c.tasks
        batch = StreamingBatch(
            t.group_size, c.trajectory, c.trainer.micro_step_tokens, c.run.seed, step, self.carried
        )
        carried_in, trained_from = len(self.carried), f.version
        b = _Burst(t.prompts_per_step * t.group_size)
        while True:
            while not arrived.empty():
                b.finished += 1
                self.add(step, b, batch, arrived.get())
            if b.finished == b.dispatched and b.closed_at is None:
                self.close_burst(step, b, len(batch.queue), self.stops_at_close(step, b, carried_in))
            # The water never rises inside a burst, so the policy asks for no return here.
            if self.advance(step, b, batch.queue):
                break
        future.result()  # surfaces a dispatcher error
        trained = {i for d in b.done.values() for i in d.claimed}
        self.carried = [mb for i, mb in enumerate(batch.queue) if i not in trained]
        runs = batch.num_runs if batch.queue else 0
        if carried_in or b.stopped:
            # Runs whose sequences this update trained: a run split by the stop counts in both
            # of the updates that train part of it.
            runs = len({s.run_id for i in trained for s in batch.queue[i]})
        return self.finish(
            step, started, b, batch, runs, trained_from, [batch.queue[i] for i in sorted(trained)],
            carried_in=carried_in, carried_out=len(self.carried),
        )  # fmt: skip

    def stops_at_close(self, step: int, b: _Burst, carried_in: int) -> bool:
        """With ``carry_tail`` the step may stop when its queue closes (``carries_tail``)."""
        c = self.ctx
        return carries_tail(
            "elastic",
            c.scheduler.carry_tail,
            len(b.trainers),
            ends_run=step == c.run.steps,
            checkpoint=self.checkpoint_due(step),
            stale_left=max(carried_in - c.fleet.claimed(), 0),  # claims go in queue order
        )


class InFlightStep(StreamingStep):
    """Elastic with in-flight weight updates (``scheduler.max_staleness`` = k > 0): the queue
    closes at the step's quota of complete groups (``scheduler.inflight``); executions still
    running go on under the versions that follow and land in a later step.

    Outcomes of every dispatch arrive on one queue. Those that arrive once a step's queue has
    closed wait for the next step; they still lower the water (the policy sees executions
    running, whichever step they will land in).
    """

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self.arrived: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self.held: list[Outcome] = []
        """Arrived after the last step's queue closed: they lead this step's."""
        self.running: dict[str, int] = {}
        """Execution → the version it was dispatched under, until it ends."""
        self.ahead: set[str] = set()
        """Executions dispatched by the step before as its look-ahead."""
        self.pending: dict[tuple[int, str], list[tuple[Outcome, TrajectoryTree | None]]] = {}
        self.futures: list[concurrent.futures.Future[list[Outcome]]] = []
        self.stopping: set[str] = set()
        """The step's stale executions, stopped at its quota."""
        self.asked = False

    def run(self, step: int) -> StepRecord:
        c, f = self.ctx, self.ctx.fleet
        started = self.begin(step)
        f.reset_claims()
        barrier = step == c.run.steps or self.checkpoint_due(step)
        self.dispatch_with_lookahead(step, barrier)
        t = c.tasks
        batch = StreamingBatch(
            t.group_size, c.trajectory, c.trainer.micro_step_tokens, c.run.seed, step, pending=self.pending
        )
        trained_from = f.version
        b = _Burst(len(self.running))
        self.stopping, self.asked = set(), False
        early, self.held = self.held, []
        for outcome in early:
            self.add(step, b, batch, outcome)
        while True:
            self.surface_errors()
            # One outcome at a time, the quota checked after each: outcomes that arrived while
            # the loop was busy (a switch, a load) beyond the quota wait for the next step.
            while not self.arrived.empty():
                outcome = self.arrived.get()
                self.running.pop(outcome.execution.run_id, None)
                b.finished += 1
                if b.closed_at is None:
                    self.add(step, b, batch, outcome)
                    self.close_at_quota(step, b, batch, barrier, trained_from)
                else:
                    self.held.append(outcome)
            if b.closed_at is None:
                self.close_at_quota(step, b, batch, barrier, trained_from)
            if self.advance(step, b, batch.queue):
                break
        runs = batch.num_runs if batch.queue else 0
        return self.finish(step, started, b, batch, runs, trained_from, batch.queue)

    def close_at_quota(
        self, step: int, b: _Burst, batch: StreamingBatch, barrier: bool, trained_from: int
    ) -> None:
        """At the quota, stop the stale executions (once); close the queue once they have
        ended (``scheduler.inflight``; a barrier step waits for every execution)."""
        c, quota, k = self.ctx, self.ctx.tasks.prompts_per_step, self.ctx.scheduler.max_staleness
        if not barrier and not self.asked and batch.complete >= quota:
            self.asked = True
            self.stopping = set(to_stop(self.running, trained_from, k))
            if self.stopping:
                c.sampler.stop_runs(sorted(self.stopping))
                c.events.emit(ev.StaleStopped(step=step, runs=sorted(self.stopping), max_staleness=k))
        stale = len(self.stopping & self.running.keys())
        if closes(batch.complete, quota, len(self.running), stale, barrier):
            self.close_burst(step, b, len(batch.queue), False)

    def dispatch_with_lookahead(self, step: int, barrier: bool) -> None:
        """This step's prompts the last one did not dispatch ahead, and the next step's
        look-ahead (``scheduler.inflight.lookahead``), each under its own step's directories."""
        c, t = self.ctx, self.ctx.tasks
        ahead = lookahead(step, c.run.steps, barrier, t.prompts_per_step, c.scheduler.lookahead)
        own = c.data.jobs(step)
        own = [(run, task) for run, task in own if run not in self.ahead]
        nxt = c.data.jobs(step + 1, ahead) if ahead else []
        for s, jobs in ((step, own), (step + 1, nxt)):
            if jobs:
                self.running |= dict.fromkeys((run for run, _ in jobs), c.fleet.version)
                workspaces, journal = c.run_dir.step_workspaces(s), c.run_dir.journal(s)
                self.futures.append(c.sampler.dispatch(jobs, workspaces, self.arrived.put, journal))
        self.ahead = {run for run, _ in nxt}

    def surface_errors(self) -> None:
        """A dispatcher's error, raised here; finished dispatches are forgotten."""
        for fut in [x for x in self.futures if x.done()]:
            self.futures.remove(fut)
            fut.result()


STEP_KINDS: dict[str, type[StepKind]] = {"colocate": ColocateStep, "async": AsyncStep, "elastic": ElasticStep}


def step_kind(sched: SchedulerConfig) -> type[StepKind]:
    """The step kind that runs ``sched``'s mode."""
    return InFlightStep if in_flight(sched) else STEP_KINDS[sched.mode]
