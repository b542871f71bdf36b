"""Scheduling policy: pure functions of the run's state, no I/O.

The same code is used by the MPI runtime and the discrete-event simulator. The policy knows
nothing about MPI, HTTP or models: it only says which role each cell takes next.

```
 elastic (the water-level rule; cells in switch order, core first; one switch at a time)
   w = d − f                         executions in flight in this burst (never rises in it)
   C_R = capacity sampling now       (sampling cells + standalone pool)
   next = first cell not training    (training cells always form a prefix 0..k-1)

   SAMPLING ──▶ TRAINING   if w ≤ C_R − C_next  and  queued micro-steps ≥ min_queued
                           (and C_R − C_next > 0 while executions run: one engine always serves)
   TRAINING ──▶ SAMPLING   last of the prefix first, if w > C_R (executions would lack a server),
                           or once the step's gradient is applied and the next burst needs the
                           capacity — the core stays if the next step's data is already queued
   carry_tail (ours)       the step is applied when its burst ends; the untrained micro-steps
                           lead the next step's queue (``carries_tail``)
 async     a fixed split: the first async_train_cells cells train, the rest sample, always
 colocate  all sample while executions run; all train once the burst has ended; all sample again
           once the step is applied
```
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_hpc.recipe.schema import Mode
from gyre_hpc.runtime.protocol import Role


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
    """A step is being trained: its gradient is not applied yet."""
    min_queued: int = 1
    async_train_cells: int = 1
    switching: bool = False
    """A switch is under way: switches are serial."""

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
class Switch:
    cell: int
    role: Role
    reason: str


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


def decide(s: SchedState) -> list[Switch]:
    """The next role switches (serial: at most one while elastic; none while one is under way)."""
    if s.switching:
        return []
    if s.mode == "async":
        want = initial_roles("async", len(s.roles), s.async_train_cells)
        return [Switch(c, r, "fixed split") for c, r in enumerate(want) if s.roles[c] != r]
    if s.mode == "colocate":
        if s.water == 0 and (s.queued > 0 or s.step_open):
            target, why = Role.TRAINING, "burst over"
        elif s.water > 0:
            target, why = Role.SAMPLING, "executions running"
        else:
            return []
        return [Switch(c, target, why) for c, r in enumerate(s.roles) if r != target]
    return _elastic(s)


def _elastic(s: SchedState) -> list[Switch]:
    k, c_r, w = s.training_prefix, s.rollout_capacity, s.water
    if k > 0:
        if w > c_r:
            return [Switch(k - 1, Role.SAMPLING, f"w={w} > C_R={c_r}")]
        if not s.step_open and s.queued < s.min_queued:
            return [Switch(k - 1, Role.SAMPLING, "step applied, nothing queued")]
    # While executions run, some engine must keep serving them (C_R − C_e > 0); after the
    # burst every cell may train.
    left = c_r - s.capacity[k] if k < len(s.roles) else 0
    if k < len(s.roles) and s.queued >= s.min_queued and w <= left and (left > 0 or w == 0):
        return [Switch(k, Role.TRAINING, f"w={w} <= C_R-C_e={c_r - s.capacity[k]}, {s.queued} queued")]
    return []
