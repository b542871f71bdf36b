"""Scheduling policy: pure functions of the run's state, no I/O.

The same code is used by the step kinds (``scheduler.steps``), which the MPI runtime and the
discrete-event simulator (``sim.simulate``) both run. The policy knows nothing about MPI, HTTP or
models: it only says which role each cell takes next. Both sides build what it sees with one
function, ``sched_state``.

```
 elastic (the water-level rule; cells in switch order, core first; one switch at a time)
   w = d − f                         executions in flight in this burst (never rises in it)
   C_R = capacity sampling now       (sampling cells + standalone pool)
   next = first cell not training    (training cells always form a prefix 0..k-1)

   SAMPLING ──▶ TRAINING   if w ≤ C_R − C_next  and  queued micro-steps ≥ min_queued
                           (and C_R − C_next > 0 while executions run: one engine always serves;
                           once the burst has ended any queued micro-step is enough)
   TRAINING ──▶ SAMPLING   last of the prefix first, if w > C_R (executions would lack a server),
                           or once the step is closed (its update applied)
   carry_tail (ours)       the step is applied when its burst ends; the untrained micro-steps
                           lead the next step's queue (``carries_tail``)
 async     a fixed split: the first async_train_cells cells train, the rest sample, always
 colocate  all sample while executions run; all train once the burst has ended and micro-steps
           are queued; all sample again once the step is closed
```

Step boundaries, decided once here and followed by the runtime and the simulator alike:

1. A step *opens* when its burst is dispatched and *closes* when its update is applied (the
   core has published version v+1, or, with nothing to learn, checkpointed v).
2. ``queued`` counts the micro-steps of the open step packed and not yet claimed: carried
   micro-steps (``carry_tail``) count from the step they are carried into; nothing counts once
   a step has stopped (``carry_tail`` at its burst's end) or closed.
3. Between a close and the next dispatch the policy sees the closed step: water 0, nothing
   queued, ``step_open`` false. Sampling engines load v+1 first; then the policy returns the
   training cells (elastic: last first, one at a time; colocate: all at once), each loading v+1
   before it admits calls again.
4. Elastic and colocate dispatch the next burst only once the policy has nothing left to
   switch back, so every burst starts on every cell. Async dispatches burst k+1 as soon as
   burst k has ended (sampling never waits for training) and never switches.
5. Switches are serial: a step kind carries out each switch the policy returned (drain, switch,
   load) before it asks again; the simulator runs the same step kinds, so it does the same.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gyre_hpc.recipe.schema import Mode, SchedulerConfig


class Role(enum.StrEnum):
    """What a cell does now. A cell says hello IDLE and takes its first role from the controller."""

    IDLE = "idle"
    SAMPLING = "sampling"
    TRAINING = "training"


def initial_roles(mode: Mode, cells: int, async_train_cells: int) -> list[Role]:
    """Roles of cells 0..cells-1 when the run starts.

    elastic and colocate start with every cell sampling (training needs data first); async keeps
    a fixed split for the whole run: the first ``async_train_cells`` cells (core first) train.
    """
    if mode == "async":
        return [Role.TRAINING if c < async_train_cells else Role.SAMPLING for c in range(cells)]
    return [Role.SAMPLING] * cells


@dataclass(frozen=True)
class SchedState:
    """What the policy sees: roles in switch order, capacities and the burst's counters."""

    mode: Mode
    roles: tuple[Role, ...]
    capacity: tuple[int, ...]
    """Concurrent executions each cell serves while sampling."""
    pool_capacity: int
    dispatched: int
    """d: executions dispatched in the current burst."""
    finished: int
    """f: executions of the current burst that ended (done, failed or timed out)."""
    queued: int
    """Micro-steps packed and not yet claimed."""
    step_open: bool
    """A step is being trained: its update is not applied yet."""
    min_queued: int = 1
    async_train_cells: int = 1

    @property
    def water(self) -> int:
        return self.dispatched - self.finished

    @property
    def rollout_capacity(self) -> int:
        sampling = (c for c, r in zip(self.capacity, self.roles, strict=True) if r == Role.SAMPLING)
        return self.pool_capacity + sum(sampling)

    @property
    def training_prefix(self) -> int:
        k = 0
        while k < len(self.roles) and self.roles[k] == Role.TRAINING:
            k += 1
        return k


@dataclass(frozen=True)
class StepCounters:
    """The counters of the step in hand, as the runtime and the simulator both keep them."""

    dispatched: int = 0
    """d of the step's burst."""
    finished: int = 0
    """f of the step's burst."""
    packed: int = 0
    """Micro-steps in the step's queue so far (carried ones included)."""
    claimed: int = 0
    """Claims handed out from the step's queue (a waiting trainer may hold one ahead)."""
    open: bool = False
    """Dispatched and not yet closed."""
    stopped: bool = False
    """``carry_tail``: the step stopped training at its burst's end."""

    def closed(self) -> StepCounters:
        """The same step once its update is applied (boundary rule 3)."""
        return StepCounters(dispatched=self.dispatched, finished=self.finished)


def sched_state(
    sched: SchedulerConfig,
    roles: list[Role] | tuple[Role, ...],
    capacity: list[int] | tuple[int, ...],
    pool_capacity: int,
    counters: StepCounters,
) -> SchedState:
    """What the policy sees, from the counters (boundary rules 2 and 3)."""
    live = counters.open and not counters.stopped
    return SchedState(
        mode=sched.mode,
        roles=tuple(roles),
        capacity=tuple(capacity),
        pool_capacity=pool_capacity,
        dispatched=counters.dispatched,
        finished=counters.finished,
        queued=max(counters.packed - counters.claimed, 0) if live else 0,
        step_open=counters.open,
        min_queued=sched.min_queued_microsteps,
        async_train_cells=sched.async_train_cells,
    )


@dataclass(frozen=True, kw_only=True)
class RoleChange:
    """A cell to take ``role``, and why (the rule that fired)."""

    cell: int
    role: Role
    reason: str


def writes_checkpoint(step: int, every: int, last_step: int) -> bool:
    """Whether ``step`` ends with a checkpoint: every ``every`` steps (0: never) and the last one."""
    return bool(every) and (step % every == 0 or step == last_step)


def carries_tail(
    mode: Mode, carry_tail: bool, trainers: int, ends_run: bool, checkpoint: bool, stale_left: int
) -> bool:
    """Whether an elastic step is applied as soon as its burst ends (ours, ``carry_tail``).

    The paper's rule trains the whole queue before applying, so the next burst waits for the
    training tail: the groups that complete last, at the timeout, all at once. With
    ``carry_tail`` the cells finish the micro-step in hand, the step is applied, the next burst
    starts, and the untrained rest leads the next step's queue (trained one version stale, its
    behaviour log-probs and the ratio clip account for that). Never when no cell is training
    (nothing would be applied), on the run's last step, on a step that writes a checkpoint (a
    checkpoint leaves no work in flight), or while micro-steps carried into this step are still
    untrained (``stale_left``): nothing is carried twice, so staleness stays at most one version
    and the carried work cannot pile up.
    """
    return (
        mode == "elastic"
        and carry_tail
        and trainers > 0
        and not ends_run
        and not checkpoint
        and stale_left == 0
    )


def decide(s: SchedState) -> list[RoleChange]:
    """The next role switches (at most one while elastic: boundary rule 5)."""
    if s.mode == "async":
        want = initial_roles("async", len(s.roles), s.async_train_cells)
        return [
            RoleChange(cell=c, role=r, reason="fixed split") for c, r in enumerate(want) if s.roles[c] != r
        ]
    if s.mode == "colocate":
        return _colocate(s)
    return _elastic(s)


def _colocate(s: SchedState) -> list[RoleChange]:
    if s.water > 0:
        target, why = Role.SAMPLING, "executions running"
    elif s.step_open and s.queued > 0:
        target, why = Role.TRAINING, "burst over"
    elif not s.step_open:
        target, why = Role.SAMPLING, "step closed"
    else:  # the queue is being trained out
        return []
    return [RoleChange(cell=c, role=target, reason=why) for c, r in enumerate(s.roles) if r != target]


def _elastic(s: SchedState) -> list[RoleChange]:
    k, c_r, w = s.training_prefix, s.rollout_capacity, s.water
    if k > 0:
        if w > c_r:
            return [RoleChange(cell=k - 1, role=Role.SAMPLING, reason=f"w={w} > C_R={c_r}")]
        if not s.step_open:
            return [RoleChange(cell=k - 1, role=Role.SAMPLING, reason="step closed")]
    # While executions run, some engine must keep serving them (C_R − C_e > 0); after the
    # burst every cell may train.
    left = c_r - s.capacity[k] if k < len(s.roles) else 0
    enough = s.queued >= s.min_queued or (w == 0 and s.queued > 0)  # after the burst: any work
    if k < len(s.roles) and enough and w <= left and (left > 0 or w == 0):
        why = f"w={w} <= C_R-C_e={c_r - s.capacity[k]}, {s.queued} queued"
        return [RoleChange(cell=k, role=Role.TRAINING, reason=why)]
    return []
