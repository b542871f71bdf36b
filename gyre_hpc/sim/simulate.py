"""The discrete-event loop: executions, micro-steps and role switches on simulated cells.

```
 events (time-ordered): execution ends · micro-step ends · switch ends · publication ends
   after each: start waiting executions on free slots; idle trainers take the next micro-step;
               decide(SchedState) — the runtime's policy — and start the switches it returns
```

Nothing here decides a role: ``scheduler.policy.decide`` does, exactly as in the runtime.
Time only moves between events; there is no compute.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from gyre_hpc.recipe.schema import Mode
from gyre_hpc.runtime.protocol import Role
from gyre_hpc.scheduler.policy import SchedState, decide, initial_roles
from gyre_hpc.sim.config import SimConfig


@dataclass
class CellTime:
    sampling: float = 0.0
    training: float = 0.0
    idle: float = 0.0
    switching: float = 0.0


@dataclass
class SimResult:
    mode: Mode
    step_ends: list[float]
    total_s: float
    cells: list[CellTime]
    switches: int
    timeline: list[tuple[int, float, float, str]] = field(default_factory=list)
    """(cell, start, end, what) for a Gantt chart."""

    @property
    def step_times(self) -> list[float]:
        return [b - a for a, b in zip([0.0, *self.step_ends], self.step_ends, strict=False)]


class Simulation:
    def __init__(self, cfg: SimConfig, mode: Mode) -> None:
        self.cfg, self.mode = cfg, mode
        self.rng = random.Random(cfg.seed)
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
        self.switches = 0
        self.step_ends: list[float] = []
        # burst bookkeeping
        self.burst = 0
        self.d = self.f = 0
        self.waiting: list[int] = []  # execution ids waiting for a slot
        self.running = 0
        self.remaining: dict[int, float] = {}
        self.group_left: dict[int, int] = {}
        self.queue = 0  # micro-steps available
        self.training_step = 0  # step whose micro-steps are queued / trained (0: none)
        self.step_work: dict[int, int] = {}  # step -> micro-steps not yet trained (incl. not yet queued)
        self.closed: set[int] = set()
        self.publishing = False
        self.next_exec = 0
        self.exec_group: dict[int, int] = {}  # execution -> its group
        self.pending_release: dict[int, int] = {}  # step -> micro-steps ready but not yet claimable

    # ---- events -----------------------------------------------------------------------------

    def at(self, t: float, kind: str, who: int) -> None:
        self._n += 1
        heapq.heappush(self.events, (t, self._n, kind, who))

    def run(self) -> SimResult:
        self.dispatch()
        self.react()
        while self.events and len(self.step_ends) < self.cfg.steps:
            t, _, kind, who = heapq.heappop(self.events)
            self.now = t
            getattr(self, f"on_{kind}")(who)
            self.react()
        for c in range(self.cfg.cells):
            self.mark(c, self.state_of[c])
        return SimResult(self.mode, self.step_ends, self.now, self.cells, self.switches, self.timeline)

    def mark(self, cell: int, what: str) -> None:
        """Close the cell's current segment and open ``what``."""
        start, span = self.since[cell], self.now - self.since[cell]
        prev = self.state_of[cell]
        slot = {"sampling": "sampling", "training": "training", "idle": "idle", "switching": "switching"}[
            prev
        ]
        setattr(self.cells[cell], slot, getattr(self.cells[cell], slot) + span)
        if span > 0:
            self.timeline.append((cell, start, self.now, prev))
        self.since[cell], self.state_of[cell] = self.now, what

    # ---- sampling ---------------------------------------------------------------------------

    def dispatch(self) -> None:
        """A new burst: prompts × group executions, each with a long-tailed duration."""
        cfg = self.cfg
        self.burst += 1
        self.d += cfg.prompts * cfg.group_size
        self.step_work[self.burst] = 0
        mu = math.log(cfg.duration_median_s)
        for g in range(cfg.prompts):
            gid = self.burst * 10_000 + g
            self.group_left[gid] = cfg.group_size
            for _ in range(cfg.group_size):
                e = self.next_exec
                self.next_exec += 1
                self.remaining[e] = min(self.rng.lognormvariate(mu, cfg.duration_sigma), cfg.timeout_s)
                self.exec_group[e] = gid
                self.waiting.append(e)

    def slots(self) -> int:
        return self.cfg.pool_capacity + sum(
            self.cfg.capacity
            for c, r in enumerate(self.roles)
            if r == Role.SAMPLING and c not in self.switching
        )

    def start_waiting(self) -> None:
        while self.waiting and self.running < self.slots():
            e = self.waiting.pop(0)
            self.running += 1
            self.at(self.now + self.remaining[e], "exec_end", e)

    def on_exec_end(self, e: int) -> None:
        self.running -= 1
        self.f += 1
        gid = self.exec_group.pop(e)
        self.group_left[gid] -= 1
        step = gid // 10_000
        per_exec = max(1, round(self.cfg.train_s_per_exec / self.cfg.micro_step_s))
        self.step_work[step] += per_exec
        if self.group_left[gid] == 0 and self.cfg.streaming:
            self.release(step, self.cfg.group_size * per_exec)
        if self.burst_done(step):
            if not self.cfg.streaming:
                self.release(step, self.step_work[step])
            self.closed.add(step)

    def burst_done(self, step: int) -> bool:
        return all(left == 0 for gid, left in self.group_left.items() if gid // 10_000 == step)

    def release(self, step: int, micro_steps: int) -> None:
        if self.training_step in (0, step):
            self.training_step = step
        self.pending_release.setdefault(step, 0)
        self.pending_release[step] += micro_steps

    # ---- training -----------------------------------------------------------------------------

    def on_micro_end(self, cell: int) -> None:
        self.busy[cell] = False
        self.step_work[self.training_step] -= 1
        self.mark(cell, "training")

    def feed_trainers(self) -> None:
        step = self.training_step
        if step and step in self.pending_release:  # micro-steps of the step in training become claimable
            self.queue += self.pending_release.pop(step)
        for c, r in enumerate(self.roles):
            if r == Role.TRAINING and c not in self.switching and not self.busy[c]:
                if self.queue:
                    self.queue -= 1
                    self.busy[c] = True
                    if self.state_of[c] != "training":
                        self.mark(c, "training")
                    self.at(self.now + self.cfg.micro_step_s, "micro_end", c)
                elif self.state_of[c] != "idle":
                    self.mark(c, "idle")
        if step and step in self.closed and self.step_work.get(step) == 0 and not self.publishing:
            if not any(self.busy.values()):
                self.publishing = True
                self.at(self.now + self.cfg.publish_s, "published", step)

    def on_published(self, step: int) -> None:
        self.publishing = False
        self.step_ends.append(self.now)
        self.training_step = 0
        later = [s for s in self.pending_release if s > step]
        if later:
            self.training_step = min(later)
        if self.mode != "async" or self.burst <= step + 1:
            if self.burst == step:
                self.dispatch()

    # ---- switches -----------------------------------------------------------------------------

    def on_switch_end(self, cell: int) -> None:
        del self.switching[cell]
        self.mark(cell, "sampling" if self.roles[cell] == Role.SAMPLING else "idle")

    def react(self) -> None:
        """After every event: serve, train, and let the policy decide (serial switches)."""
        if self.mode == "async" and self.burst == len(self.step_ends) + 1 and self.burst_done(self.burst):
            self.dispatch()  # sampling never waits: burst k+1 while step k trains (staleness 1)
        self.start_waiting()
        self.feed_trainers()
        state = SchedState(
            mode=self.mode,
            roles=tuple(self.roles),
            capacity=(self.cfg.capacity,) * self.cfg.cells,
            pool_capacity=self.cfg.pool_capacity,
            dispatched=self.d,
            finished=self.f,
            queued=self.queue + sum(v for s, v in self.pending_release.items() if s == self.training_step),
            step_open=self.training_step != 0,
            min_queued=self.cfg.min_queued,
            async_train_cells=self.cfg.async_train_cells,
            switching=bool(self.switching),
        )
        for sw in decide(state):
            if sw.role == Role.SAMPLING and self.busy[sw.cell]:
                continue  # it finishes its micro-step first
            cost = self.cfg.switch_to_train_s if sw.role == Role.TRAINING else self.cfg.switch_to_sample_s
            self.roles[sw.cell] = sw.role
            self.switching[sw.cell] = self.now + cost
            self.switches += 1
            self.mark(sw.cell, "switching")
            self.at(self.now + cost, "switch_end", sw.cell)


def simulate(cfg: SimConfig, mode: Mode) -> SimResult:
    return Simulation(cfg, mode).run()
