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
from gyre_hpc.step.batch import Pending, StepBatch, StreamingBatch, step_batch
from gyre_hpc.step.stats import staleness, token_staleness
from gyre_hpc.trajectory.sequences import StepQueue, loss_divisor
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


@dataclass(kw_only=True)
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


@dataclass(kw_only=True)
class StepRecord:
    """What one step did, whatever its kind; ``step_event`` turns it into the ``step`` event."""

    step: int
    started: float
    sampled: float
    """When its burst ended."""
    stats: dict[str, Any]
    """``step_stats.step_stats`` of its batch."""
    loss_divisor: int
    """What the summed loss is divided by: the runs it is averaged over, or its tokens or paths
    (``trajectory.loss_mean``)."""
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
        loss=sum(d.loss_sum for d in done) / max(r.loss_divisor, 1),
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
        self, step: int, switches: list[RoleChange], queue: StepQueue, closed: bool, water: int
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

    def train_queue(self, step: int, queue: StepQueue, counters: StepCounters) -> dict[int, TrainDone]:
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
        self, step: int, done: dict[int, TrainDone], divisor: int, tito_bytes: dict[str, int]
    ) -> StepApplied:
        c = self.ctx
        # A checkpoint counts once its step is recorded: the controller marks it after the record.
        state = {"tito_bytes": tito_bytes, "awaits_record": True}
        return c.fleet.apply(step, done, divisor, self.checkpoint_due(step), state)

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
        divisor = batch.divisor if batch.queue else 0
        applied = self.apply(step, done, divisor, tito_bytes)
        self.close(step, counters)
        return StepRecord(
            step=step,
            started=started,
            sampled=sampled,
            stats=batch.stats,
            loss_divisor=divisor,
            done=done,
            applied=applied,
            skipped=divisor == 0,
            staleness=staleness(batch.trees.values(), trained_from),
            switches=self.switches,
            staleness_tokens=token_staleness(batch.queue, trained_from),
        )


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
class Burst:
    """A streaming step while it runs (elastic, in-flight): its counters, its queue and its
    trainers.

    ```
     OPEN ── an execution ends (take): once its prompt group is complete, the group's micro-steps
       │     join the queue and go to the cells already training
       │  ── the policy sends a cell to training (join): it claims from the queue so far
       │
       │  sampled: the last execution ended (elastic), or the quota of groups is in and the stale
       │  executions stopped (in-flight)
       ▼
     CLOSED ── the queue's length is final; ``stopped`` (carry_tail): no cell claims any more
       │
       ▼  every cell that joined reported TrainDone (an empty queue needs no trainer)
     TRAINED OUT ── the core applies, the step closes (the policy returns the trainers)
    ```
    """

    step: int
    batch: StreamingBatch
    dispatched: int
    """d: executions this burst waits for."""
    trained_from: int
    """The version its trainers train from."""
    finished: int = 0
    """f: of them, those that ended."""
    trainers: dict[int, float] = field(default_factory=dict)
    """Cell → when it joined."""
    done: dict[int, TrainDone] = field(default_factory=dict)
    closed_at: float | None = None
    stopped: bool = False

    @property
    def queue(self) -> StepQueue:
        return self.batch.queue

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    def trained_out(self) -> bool:
        """Closed, and every cell that joined has reported (a non-empty queue needs one)."""
        if not self.closed or set(self.done) != set(self.trainers):
            return False
        return bool(self.trainers) or not self.queue


class StreamingStep(StepKind):
    """What elastic and in-flight share: each prompt group becomes micro-steps as soon as its
    last run ends, cells join the step one by one (the water-level rule), and the step is
    applied once the trainers have trained the closed queue out. Each turn of their loops takes
    the executions that ended, closes the queue when the burst is sampled, lets the cells the
    policy sends join, and waits for one trainer's report."""

    def open(
        self, step: int, dispatched: int, carried: StepQueue | tuple[()] = (), pending: Pending | None = None
    ) -> Burst:
        """The step's burst, its queue led by ``carried`` micro-steps; nobody claims yet."""
        c, t = self.ctx, self.ctx.tasks
        c.fleet.reset_claims()
        batch = StreamingBatch(
            t.group_size, c.trajectory, c.trainer.micro_step_tokens, c.run.seed, step, carried, pending
        )
        return Burst(step=step, batch=batch, dispatched=dispatched, trained_from=c.fleet.version)

    def take(self, b: Burst, outcome: Outcome) -> None:
        """Book one ended execution; the micro-steps its group completed go to the trainers."""
        run = outcome.execution.run_id
        if new := b.batch.add(outcome, self.ctx.sampler.trees([run]).get(run)):
            self.ctx.fleet.extend(list(b.trainers), b.step, new)

    def close_queue(self, b: Burst, stop: bool) -> None:
        """The queue is complete: no micro-step joins it any more (``stop``: none is claimed)."""
        c = self.ctx
        b.closed_at, b.stopped = c.clock(), stop
        c.fleet.close_queue(list(b.trainers), b.step, len(b.queue), stop)
        c.events.emit(
            ev.BurstEnd(step=b.step, micro_steps=len(b.queue), trainers=sorted(b.trainers), stop=stop)
        )

    def join_cells(self, b: Burst) -> None:
        """The cells the policy sends to training join with the queue so far. The water never
        rises inside a burst, so the policy sends none back here."""
        for s in decide(self.state(self.counters(b))):
            self.to_training(b.step, [s], b.queue, b.closed, b.dispatched - b.finished)
            b.trainers[s.cell] = self.ctx.clock()

    def await_report(self, b: Burst, ended: queue.SimpleQueue[Outcome]) -> None:
        """One trainer's report (or a short wait for one), unless the queue is trained out or an
        execution ended meanwhile (a switch takes time): that one is taken first."""
        if b.trained_out() or not ended.empty():
            return
        if (msg := self.ctx.fleet.receive()) is not None and msg.step == b.step:
            b.done[msg.cell] = msg

    def counters(self, b: Burst) -> StepCounters:
        return StepCounters(
            dispatched=b.dispatched,
            finished=b.finished,
            packed=len(b.queue),
            claimed=self.ctx.fleet.claimed(),
            open=True,
            stopped=b.stopped,
        )

    def finish(self, b: Burst, started: float, divisor: int, trained: StepQueue, **carry: int) -> StepRecord:
        """Apply what the cells trained (``trained``: those micro-steps), close the step, and
        record it."""
        _, tito_bytes = self.burst_ended()
        applied = self.apply(b.step, b.done, divisor, tito_bytes)
        self.close(b.step, self.counters(b))
        early = b.closed_at - min(b.trainers.values()) if b.trainers and b.closed_at else None
        return StepRecord(
            step=b.step,
            started=started,
            sampled=b.closed_at or self.ctx.clock(),
            stats=b.batch.stats(),
            loss_divisor=divisor,
            done=b.done,
            applied=applied,
            skipped=divisor == 0,
            staleness=staleness(b.batch.trees.values(), b.trained_from),
            switches=self.switches,
            staleness_tokens=token_staleness(trained, b.trained_from),
            train_before_burst_end_s=None if early is None else round(max(early, 0.0), 3),
            **carry,
        )


class ElasticStep(StreamingStep):
    """Cells move to training one by one while the burst still runs; the queue closes when the
    burst's last execution ends (with ``carry_tail``, the step may then stop and leave the rest
    of its queue to the next one)."""

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self.carried: StepQueue = []
        """``carry_tail``: micro-steps the previous step left; they lead this step's queue."""

    def run(self, step: int) -> StepRecord:
        started = self.begin(step)
        ended: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        future = self.dispatch(step, on_outcome=ended.put)
        t = self.ctx.tasks
        b = self.open(step, t.prompts_per_step * t.group_size, carried=self.carried)
        carried_in = len(self.carried)
        while not b.trained_out():
            while not ended.empty():
                b.finished += 1
                self.take(b, ended.get())
            if b.finished == b.dispatched and not b.closed:
                self.close_queue(b, stop=self.stops_at_close(b, carried_in))
            self.join_cells(b)
            self.await_report(b, ended)
        future.result()  # surfaces a dispatcher error
        trained = {i for d in b.done.values() for i in d.claimed}
        self.carried = [mb for i, mb in enumerate(b.queue) if i not in trained]
        return self.finish(
            b,
            started,
            self.divisor_trained(b, trained, carried_in),
            [b.queue[i] for i in sorted(trained)],
            carried_in=carried_in,
            carried_out=len(self.carried),
        )

    def stops_at_close(self, b: Burst, carried_in: int) -> bool:
        """With ``carry_tail`` the step may stop when its queue closes (``carries_tail``)."""
        c = self.ctx
        return carries_tail(
            "elastic",
            c.scheduler.carry_tail,
            len(b.trainers),
            ends_run=b.step == c.run.steps,
            checkpoint=self.checkpoint_due(b.step),
            stale_left=max(carried_in - c.fleet.claimed(), 0),  # claims go in queue order
        )

    def divisor_trained(self, b: Burst, trained: set[int], carried_in: int) -> int:
        """What the loss is divided by: the batch's divisor, or, where micro-steps were carried in
        or out, that of the sequences this update trained (a run split by a stop counts in both
        updates that train part of it)."""
        if not b.queue:
            return 0
        if carried_in or b.stopped:
            seqs = [s for i in trained for s in b.queue[i]]
            return loss_divisor(seqs, self.ctx.trajectory.loss_mean)
        return b.batch.divisor


class InFlightStep(StreamingStep):
    """Elastic with in-flight weight updates (``scheduler.max_staleness`` = k > 0): the queue
    closes at the step's quota of complete groups (``scheduler.inflight``); executions still
    running go on under the versions that follow and land in a later step.

    ```
     an execution under in-flight updates, as this step kind books it:
       dispatched with its own step, or by the step before as its look-ahead (ahead)
         ▼
       running {run: the version it was dispatched under}
         ├─ ends before the step's queue closes ─▶ taken: its group (pending until complete,
         │                                          across steps) trains in this step
         ├─ ends after it closed ────────────────▶ held: taken first by the next step
         └─ still running at the quota, and a later step would train it more than k versions
            behind ─▶ stopping: stopped now, partially scored, and taken like any that ends
    ```

    Every execution that ends lowers the water, whichever step it lands in (the policy sees
    executions running).
    """

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self.ended: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        """Every dispatch's executions as they end, in the order they end."""
        self.held: list[Outcome] = []
        """Ended after the last step's queue closed: they lead this step's."""
        self.running: dict[str, int] = {}
        """Execution → the version it was dispatched under, until it ends."""
        self.ahead: set[str] = set()
        """Executions dispatched by the step before as its look-ahead."""
        self.pending: Pending = {}
        """Ended executions of groups not yet complete, across steps (``StreamingBatch``)."""
        self.futures: list[concurrent.futures.Future[list[Outcome]]] = []
        self.stopping: set[str] | None = None
        """The step's stale executions, stopped at its quota (None until the quota is met)."""

    def run(self, step: int) -> StepRecord:
        started = self.begin(step)
        barrier = step == self.ctx.run.steps or self.checkpoint_due(step)
        self.dispatch_with_lookahead(step, barrier)
        b = self.open(step, len(self.running), pending=self.pending)
        self.stopping = None
        early, self.held = self.held, []
        for outcome in early:
            self.take(b, outcome)
        while not b.trained_out():
            self.surface_errors()
            self.take_ended(b, barrier)
            if not b.closed:
                self.close_at_quota(b, barrier)
            self.join_cells(b)
            self.await_report(b, self.ended)
        return self.finish(b, started, b.batch.divisor if b.queue else 0, b.queue)

    def take_ended(self, b: Burst, barrier: bool) -> None:
        """The executions that ended, one at a time with the quota checked after each: those that
        ended while the loop was busy (a switch, a load) beyond the quota are held for the next
        step."""
        while not self.ended.empty():
            outcome = self.ended.get()
            self.running.pop(outcome.execution.run_id, None)
            b.finished += 1
            if b.closed:
                self.held.append(outcome)
                continue
            self.take(b, outcome)
            self.close_at_quota(b, barrier)

    def close_at_quota(self, b: Burst, barrier: bool) -> None:
        """At the quota, stop the stale executions (once); close the queue once they have
        ended (``scheduler.inflight``; a barrier step waits for every execution)."""
        c, quota, k = self.ctx, self.ctx.tasks.prompts_per_step, self.ctx.scheduler.max_staleness
        if not barrier and self.stopping is None and b.batch.complete >= quota:
            self.stopping = set(to_stop(self.running, b.trained_from, k))
            if self.stopping:
                c.sampler.stop_runs(sorted(self.stopping))
                c.events.emit(ev.StaleStopped(step=b.step, runs=sorted(self.stopping), max_staleness=k))
        stale = len((self.stopping or set()) & self.running.keys())
        if closes(b.batch.complete, quota, len(self.running), stale, barrier):
            self.close_queue(b, stop=False)

    def dispatch_with_lookahead(self, step: int, barrier: bool) -> None:
        """This step's prompts the last one did not dispatch ahead, and the next step's
        look-ahead (``scheduler.inflight.lookahead``), each under its own step's directories."""
        c, t = self.ctx, self.ctx.tasks
        ahead = lookahead(step, c.run.steps, barrier, t.prompts_per_step, c.scheduler.lookahead)
        own = [(run, task) for run, task in c.data.jobs(step) if run not in self.ahead]
        nxt = c.data.jobs(step + 1, ahead) if ahead else []
        for s, jobs in ((step, own), (step + 1, nxt)):
            if jobs:
                self.running |= dict.fromkeys((run for run, _ in jobs), c.fleet.version)
                workspaces, journal = c.run_dir.step_workspaces(s), c.run_dir.journal(s)
                self.futures.append(c.sampler.dispatch(jobs, workspaces, self.ended.put, journal))
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
