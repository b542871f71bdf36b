"""The discrete-event loop: executions, micro-steps and role switches on simulated cells.

```
 events (time-ordered): execution ends · micro-step ends · switch ends · publication ends
   after each: start waiting executions on free slots; idle trainers take the next micro-step;
               decide(sched_state(counters)) — the runtime's policy on the runtime's view of
               the counters — and start the switches it returns
   a step closes at its publication; elastic and colocate then return their trainers and
   dispatch the next burst once the policy switches nothing more (the policy's boundary rules)
   in-flight (max_staleness k): a step's queue closes at its quota of complete groups, stale
   executions stopped first (``scheduler.inflight``); the rest run on into later steps
```

Nothing here decides a role: ``scheduler.policy.decide`` does, exactly as in the runtime, on a
state built by the same ``sched_state``. Time only moves between events; there is no compute.
Each completed step also gets its bounds (``sim.bound``): the work it was served and trained,
and, for steps in series, its on-policy bound from the work it was given.

The workload is a function from a step to its prompt groups: each group's execution durations
and the micro-steps it yields. ``sampled`` draws it from the config's distributions;
``replay`` replays the one a real run recorded.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from gyre_hpc.recipe.schema import Mode, SchedulerConfig
from gyre_hpc.scheduler.inflight import closes, lookahead, to_stop
from gyre_hpc.scheduler.policy import (
    Role,
    SchedState,
    StepCounters,
    carries_tail,
    decide,
    initial_roles,
    sched_state,
    writes_checkpoint,
)
from gyre_hpc.sim.bound import step_bound, work_bound
from gyre_hpc.sim.config import SimConfig
from gyre_hpc.trajectory.batch import pack_micro_steps


@dataclass(frozen=True)
class Group:
    """One prompt's executions and the training they yield."""

    durations: tuple[float, ...]
    """Each execution's time while served (before ``exec_overhead_s``)."""
    micro_steps: tuple[float, ...]
    """Training time of each micro-step the group yields when packed on its own (streaming)."""
    sequence_tokens: tuple[int, ...] = ()
    """Replayed workloads: the group's sequence lengths, repacked with the whole step when not
    streaming (as the runtime's ``step_batch`` does)."""


Workload = Callable[[int], list[Group]]


def sampled(cfg: SimConfig) -> Workload:
    """Log-normal durations cut at the timeout; every execution costs ``train_s_per_exec`` of
    training in micro-steps of ``micro_step_s``."""
    rng = random.Random(cfg.seed)
    mu = math.log(cfg.duration_median_s)
    per_exec = max(1, round(cfg.train_s_per_exec / cfg.micro_step_s))

    def groups(step: int) -> list[Group]:
        return [
            Group(
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


@dataclass
class CellTime:
    sampling: float = 0.0
    training: float = 0.0
    idle: float = 0.0
    switching: float = 0.0
    idle_slots: float = 0.0
    """The part of ``sampling`` in which its slots stood empty (sampling time × the share of
    slots empty): a sampling cell holding one last execution is mostly idle, not busy."""


@dataclass
class SimResult:
    mode: Mode
    step_ends: list[float]
    total_s: float
    cells: list[CellTime]
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
        """Shares of cell time: ``sampling`` with its slots busy, ``idle slots`` the rest of the
        sampling role, then training, idle and switching."""
        cell_s = self.total_s * len(self.cells) or 1.0
        total = lambda what: sum(getattr(c, what) for c in self.cells) / cell_s  # noqa: E731
        return {
            "sampling": total("sampling") - total("idle_slots"),
            "idle slots": total("idle_slots"),
            **{what: total(what) for what in ("training", "idle", "switching")},
        }

    @property
    def step_times(self) -> list[float]:
        return [b - a for a, b in zip([0.0, *self.step_ends], self.step_ends, strict=False)]


class Simulation:
    def __init__(self, cfg: SimConfig, mode: Mode, workload: Workload | None = None) -> None:
        self.cfg, self.mode = cfg, mode
        self.sched = SchedulerConfig(
            mode=mode,
            async_train_cells=cfg.async_train_cells,
            min_queued_microsteps=cfg.min_queued,
            carry_tail=cfg.carry_tail,
        )
        self.workload = workload or sampled(cfg)
        self.inflight = mode == "elastic" and cfg.max_staleness > 0
        plain_elastic = mode == "elastic" and not self.inflight and not cfg.carry_tail
        self.in_series = mode == "colocate" or plain_elastic
        streams = cfg.streaming == "all" or (cfg.streaming == "elastic" and mode == "elastic")
        self.streaming = streams or self.inflight  # a quota counts complete groups as they end
        self.now = 0.0
        self.events: list[tuple[float, int, str, int]] = []
        self._n = 0
        self.roles = initial_roles(mode, cfg.cells, cfg.async_train_cells)
        self.switching: dict[int, float] = {}
        self.busy: dict[int, bool] = {c: False for c in range(cfg.cells)}  # trainer mid micro-step
        self.since = [0.0] * cfg.cells
        self.state_of = ["sampling" if r == Role.SAMPLING else "training" for r in self.roles]
        self.cells = [CellTime() for _ in range(cfg.cells)]
        self.timeline: list[tuple[int, float, float, str]] = []
        self.switch_log: list[tuple[int, int, str]] = []
        self.step_ends: list[float] = []
        # bursts
        self.burst = 0  # the newest dispatched step
        self.d = self.f = 0
        self.waiting: list[int] = []  # execution ids waiting for a slot
        self.running = 0
        self.remaining: dict[int, float] = {}
        self.group_left: dict[int, int] = {}
        self.groups: dict[int, Group] = {}
        self.next_exec = 0
        self.exec_group: dict[int, int] = {}  # execution -> its group
        self.closed: set[int] = set()  # steps whose burst has ended
        # training
        self.training_step = 1  # the oldest step not yet published: its micro-steps are claimable
        self.queue: list[float] = []  # claimable micro-steps (their training times)
        self.pending_release: dict[int, list[float]] = {}  # step -> micro-steps not yet claimable
        self.released: dict[int, int] = {}  # step -> micro-steps packed for it
        self.step_work: dict[int, int] = {}  # step -> micro-steps released and not yet trained
        self.started: dict[int, int] = {}  # step -> micro-steps trainers have taken (claims)
        self.publishing = False
        self.boundary = False  # a step has closed; its trainers return before the next burst
        self.carried: list[float] = []  # carry_tail: micro-steps left for the next step
        self.stopping: set[int] = set()  # steps applied at their burst's end (carry_tail)
        self.carried_in: dict[int, int] = {}  # step -> micro-steps carried into it
        # in-flight updates
        self.workloads: dict[int, list[Group]] = {}
        self.version = 0  # versions published
        self.first_version: dict[int, int] = {}  # execution -> the version its burst started on
        self.collect = 1  # the step complete groups join
        self.complete: dict[int, int] = {}  # step -> complete groups it holds
        self.stopped: set[int] = set()  # executions stopped for staleness
        self.stop_asked: set[int] = set()  # steps that have stopped their stale executions
        self.stale_trained: list[tuple[int, int]] = []  # (step, versions behind) of each group trained
        self.started_at: dict[int, float] = {}
        self.served: dict[int, float] = {}  # execution -> the time it was served, once it ended
        self.exec_step: dict[int, int] = {}  # execution -> the step it was dispatched for
        self.trained_s: dict[int, float] = {}  # step -> cell-seconds of the micro-steps it trained
        self.in_hand: dict[int, tuple[int, float]] = {}  # cell -> (step, seconds) of its micro-step
        # slot occupancy: ∫ (occupied slots / slots) dt, so sampling time splits into busy and idle
        self.occupied = 0.0
        self.occupancy = 0.0
        self.last_t = 0.0
        self.occupied_at = [0.0] * cfg.cells

    # ---- events -----------------------------------------------------------------------------

    def at(self, t: float, kind: str, who: int) -> None:
        self._n += 1
        heapq.heappush(self.events, (t, self._n, kind, who))

    def run(self) -> SimResult:
        self.dispatch()
        self.react()
        self.occupancy = self.slot_occupancy()
        while self.events and len(self.step_ends) < self.cfg.steps:
            t, _, kind, who = heapq.heappop(self.events)
            self.occupied += (t - self.last_t) * self.occupancy
            self.now = self.last_t = t
            getattr(self, f"on_{kind}")(who)
            self.react()
            self.occupancy = self.slot_occupancy()
        for c in range(self.cfg.cells):
            self.mark(c, self.state_of[c])
        return SimResult(
            self.mode, self.step_ends, self.now, self.cells, self.switch_log, self.timeline,
            self.bounds(), self.works(), self.cfg.publish_s, self.in_series,
        )  # fmt: skip

    def slot_occupancy(self) -> float:
        slots = self.slots()
        return min(self.running, slots) / slots if slots else 1.0

    def bounds(self) -> list[float]:
        by_step: dict[int, list[Group]] = {}
        for gid, group in sorted(self.groups.items()):
            by_step.setdefault(gid // 10_000, []).append(group)
        return [
            step_bound([g.durations for g in by_step[s]], [g.micro_steps for g in by_step[s]], self.cfg)
            for s in range(1, len(self.step_ends) + 1)
        ]

    def works(self) -> list[float]:
        """Each step's served and trained work: an execution's served time goes to its step, a
        micro-step's to the step that trained it."""
        served: dict[int, float] = {}
        for e, seconds in self.served.items():
            served[self.exec_step[e]] = served.get(self.exec_step[e], 0.0) + seconds
        steps = range(1, len(self.step_ends) + 1)
        return [work_bound(served.get(s, 0.0), self.trained_s.get(s, 0.0), self.cfg) for s in steps]

    def mark(self, cell: int, what: str) -> None:
        """Close the cell's current segment and open ``what``."""
        start, span = self.since[cell], self.now - self.since[cell]
        prev = self.state_of[cell]
        setattr(self.cells[cell], prev, getattr(self.cells[cell], prev) + span)
        if prev == "sampling":
            busy = self.occupied - self.occupied_at[cell]
            self.cells[cell].idle_slots += max(span - busy, 0.0)
        if span > 0:
            self.timeline.append((cell, start, self.now, prev))
        self.since[cell], self.state_of[cell] = self.now, what
        self.occupied_at[cell] = self.occupied

    # ---- sampling ---------------------------------------------------------------------------

    def dispatch(self) -> None:
        """A new burst: the workload's groups for the next step (and what the last one carried);
        in-flight, those not dispatched yet and the next step's look-ahead."""
        self.burst += 1
        step = self.burst
        self.released.setdefault(step, 0)
        self.step_work.setdefault(step, 0)
        for g, group in enumerate(self.step_groups(step)):
            self.start_group(step * 10_000 + g, group)
        if self.inflight:
            barrier = self.barrier(step)
            ahead = lookahead(step, self.cfg.steps, barrier, self.cfg.prompts, self.cfg.lookahead)
            for g, group in enumerate(self.step_groups(step + 1)[:ahead] if ahead else []):
                self.start_group((step + 1) * 10_000 + g, group)
        if self.carried:
            self.carried_in[step] = len(self.carried)
            self.release(step, self.carried)
            self.carried = []
        if self.inflight:
            self.check_quota()

    def step_groups(self, step: int) -> list[Group]:
        if step not in self.workloads:
            self.workloads[step] = self.workload(step)
        return self.workloads[step]

    def start_group(self, gid: int, group: Group) -> None:
        if gid in self.groups:
            return  # dispatched ahead by the step before
        self.groups[gid] = group
        self.group_left[gid] = len(group.durations)
        self.d += len(group.durations)
        for duration in group.durations:
            e = self.next_exec
            self.next_exec += 1
            self.remaining[e] = duration + self.cfg.exec_overhead_s
            self.exec_group[e] = gid
            self.exec_step[e] = gid // 10_000
            self.first_version[e] = self.version
            self.waiting.append(e)

    def barrier(self, step: int) -> bool:
        return step == self.cfg.steps or writes_checkpoint(step, self.cfg.checkpoint_every, self.cfg.steps)

    def slots(self) -> int:
        return self.cfg.pool_capacity + sum(
            self.cfg.capacity
            for c, r in enumerate(self.roles)
            if r == Role.SAMPLING and c not in self.switching
        )

    def start_waiting(self) -> None:
        while self.waiting and self.running < self.slots():
            e = self.waiting.pop(0)
            self.started_at[e] = self.now
            self.running += 1
            self.at(self.now + self.remaining[e], "exec_end", e)

    def on_exec_end(self, e: int) -> None:
        if e not in self.exec_group:
            return  # stopped earlier: its natural end no longer happens
        self.running -= 1
        self.f += 1
        gid = self.exec_group.pop(e)
        first = self.first_version.pop(e)
        self.served[e] = self.now - self.started_at.get(e, self.now)
        self.group_left[gid] -= 1
        step = gid // 10_000
        if self.inflight:
            if self.group_left[gid] == 0:
                self.complete[self.collect] = self.complete.get(self.collect, 0) + 1
                self.stale_trained.append((self.collect, self.collect - 1 - first))
                self.release(self.collect, list(self.groups[gid].micro_steps))
            self.check_quota()
            return
        if self.group_left[gid] == 0 and self.streaming:
            self.release(step, list(self.groups[gid].micro_steps))
        if self.burst_done(step):
            if not self.streaming:
                self.release(step, self.whole_step(step))
            self.closed.add(step)
            trainers = sum(r == Role.TRAINING for r in self.roles)
            stale_left = max(self.carried_in.get(step, 0) - self.started.get(step, 0), 0)
            checkpoint = writes_checkpoint(step, self.cfg.checkpoint_every, self.cfg.steps)
            ends_run = step == self.cfg.steps
            if carries_tail(self.mode, self.cfg.carry_tail, trainers, ends_run, checkpoint, stale_left):
                self.stopping.add(step)

    def check_quota(self) -> None:
        """In-flight: close the collecting step's queue at its quota, its stale executions stopped
        first (``scheduler.inflight``); barrier steps wait for every execution."""
        s = self.collect
        if s != self.burst or s in self.closed:
            return  # not dispatched yet: its groups wait in its queue
        barrier = self.barrier(s)
        complete = self.complete.get(s, 0)
        if not barrier and complete >= self.cfg.prompts and s not in self.stop_asked:
            self.stop_asked.add(s)
            for e in to_stop(self.first_version, self.version, self.cfg.max_staleness):
                self.stopped.add(e)
                if e in self.waiting:  # never started: it ends having done nothing
                    self.waiting.remove(e)
                    self.running += 1
                self.at(self.now, "exec_end", e)
        stale = sum(e in self.stopped for e in self.exec_group)
        if closes(complete, self.cfg.prompts, len(self.exec_group), stale, barrier):
            self.closed.add(s)
            self.collect = s + 1

    def whole_step(self, step: int) -> list[float]:
        """Not streaming: the step's micro-steps, made once the burst has ended."""
        groups = [g for gid, g in self.groups.items() if gid // 10_000 == step]
        if all(g.sequence_tokens or not g.micro_steps for g in groups):
            return list(packed(self.cfg, [t for g in groups for t in g.sequence_tokens]))
        return [m for g in groups for m in g.micro_steps]

    def burst_done(self, step: int) -> bool:
        return all(left == 0 for gid, left in self.group_left.items() if gid // 10_000 == step)

    def release(self, step: int, micro_steps: list[float]) -> None:
        self.released[step] = self.released.get(step, 0) + len(micro_steps)
        self.step_work[step] = self.step_work.get(step, 0) + len(micro_steps)
        self.pending_release.setdefault(step, []).extend(micro_steps)

    # ---- training -----------------------------------------------------------------------------

    def on_micro_end(self, cell: int) -> None:
        self.busy[cell] = False
        step, seconds = self.in_hand.pop(cell)
        self.trained_s[step] = self.trained_s.get(step, 0.0) + seconds
        self.step_work[self.training_step] -= 1
        self.mark(cell, "training")

    def feed_trainers(self) -> None:
        step = self.training_step
        if step in self.pending_release:  # micro-steps of the step in training become claimable
            self.queue += self.pending_release.pop(step)
        stopping = step in self.stopping
        for c, r in enumerate(self.roles):
            if r == Role.TRAINING and c not in self.switching and not self.busy[c]:
                # Nobody claims between a close and the next dispatch (boundary rule 3): the
                # groups that completed there (in-flight) wait for their step to open.
                if self.queue and not stopping and not self.boundary:
                    seconds = self.queue.pop(0)
                    self.started[step] = self.started.get(step, 0) + 1
                    self.busy[c] = True
                    self.in_hand[c] = (step, seconds)
                    if self.state_of[c] != "training":
                        self.mark(c, "training")
                    self.at(self.now + seconds, "micro_end", c)
                elif self.state_of[c] != "idle":
                    self.mark(c, "idle")
        idle = not self.publishing and not any(self.busy.values())
        if stopping and idle and self.queue:
            self.carried, self.queue = self.queue, []  # trained in the next step, one version stale
            self.step_work[step] = 0
        if step in self.closed and self.step_work[step] == 0 and idle:
            self.publishing = True
            self.at(self.now + self.cfg.publish_s, "published", step)

    def on_published(self, step: int) -> None:
        self.publishing = False
        self.version += 1
        self.training_step = step + 1
        if self.mode == "async":
            self.step_ends.append(self.now)
        else:
            self.boundary = True

    # ---- the policy ---------------------------------------------------------------------------

    def counters(self) -> StepCounters:
        step = self.training_step if not self.boundary else self.burst
        counters = StepCounters(
            self.d,
            self.f,
            self.released.get(step, 0),
            self.started.get(step, 0),
            open=step <= self.burst,
            stopped=step in self.stopping,
        )
        return counters.closed() if self.boundary else counters

    def state(self) -> SchedState:
        caps = [self.cfg.capacity] * self.cfg.cells
        return sched_state(
            self.sched, self.roles, caps, self.cfg.pool_capacity, self.counters(), bool(self.switching)
        )

    def on_switch_end(self, cell: int) -> None:
        del self.switching[cell]
        self.mark(cell, "sampling" if self.roles[cell] == Role.SAMPLING else "idle")

    def react(self) -> None:
        """After every event: serve, train, let the policy decide, and close a step's boundary."""
        if (
            self.mode == "async"
            and self.burst == len(self.step_ends) + 1
            and self.burst < self.cfg.steps
            and self.burst_done(self.burst)
        ):
            self.dispatch()  # sampling never waits: burst k+1 while step k trains (staleness 1)
        self.start_waiting()
        self.feed_trainers()
        switches = decide(self.state())
        for sw in switches:
            if sw.role == Role.SAMPLING and self.busy[sw.cell]:
                continue  # it finishes its micro-step first
            cost = self.cfg.switch_to_train_s if sw.role == Role.TRAINING else self.cfg.switch_to_sample_s
            self.roles[sw.cell] = sw.role
            self.switching[sw.cell] = self.now + cost
            self.switch_log.append((self.burst, sw.cell, str(sw.role)))
            self.mark(sw.cell, "switching")
            self.at(self.now + cost, "switch_end", sw.cell)
        if self.boundary and not switches and not self.switching:
            self.boundary = False  # every trainer is back: the step ends, the next burst starts
            self.step_ends.append(self.now)
            if self.burst < self.cfg.steps:
                self.dispatch()
                self.react()


def simulate(cfg: SimConfig, mode: Mode, workload: Workload | None = None) -> SimResult:
    return Simulation(cfg, mode, workload).run()
