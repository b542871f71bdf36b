"""Bounds no schedule beats: the work a run was given, spread over every slot and cell.

```
 work      cells · τ ≥ Σ training + (Σ served − pool · τ) / capacity    (a cell samples or trains)
           ⇒ τ ≥ (S + capacity · T) / (cells · capacity + pool) + publish   (the last one: nothing
                                                                            overlaps it)
 on-policy τ_step ≥ max(work_step, L + max(m, T_g / cells)) + publish    (steps in series)
```

``S``: sampling slot-seconds each execution was *served* (overhead included; a stopped
execution counts what it had been served when it stopped), ``T``: training cell-seconds of the
micro-steps trained. Publication counts once, the run's last: any earlier one can overlap the
next step's sampling (async, in-flight updates), or the trainers could sample meanwhile. This is
``work_bound``, the bound every mode is measured against, and a property test shows no mode of
the simulator finishes below it.

``step_bound`` is tighter and holds only where steps run in series, each sampling with the
weights the one before published (colocate, elastic without ``carry_tail`` or in-flight
updates): each step's work or its critical path (``L``: its longest execution, ``T_g`` and
``m``: the training of that execution's group and its longest micro-step, which cannot start
before it ends), plus its publication, which nothing overlaps there. Without a rollout pool the
work term is S / slots + T / cells. Pure: the simulator and ``bench modes`` put every mode's
time over the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

from gyre_hpc.sim.config import SimConfig


def work_bound(served_s: float, trained_s: float, cfg: SimConfig) -> float:
    """Served slot-seconds and trained cell-seconds spread over every slot and cell (no
    publication: ``run_bound`` adds the one nothing overlaps)."""
    return (served_s + cfg.capacity * trained_s) / (cfg.cells * cfg.capacity + cfg.pool_capacity)


def run_bound(step_work: Sequence[float], cfg: SimConfig) -> float:
    """A run whose steps had this ``work_bound`` each: their sum and the last publication."""
    return sum(step_work) + cfg.publish_s if step_work else 0.0


def step_bound(
    durations: Sequence[Sequence[float]], training: Sequence[Sequence[float]], cfg: SimConfig
) -> float:
    """The on-policy bound of one step whose groups have these execution ``durations`` (served
    time) and yield these micro-steps (``training``: their times on one cell), group by group."""
    served = [[d + cfg.exec_overhead_s for d in group] for group in durations]
    if not any(served):
        return 0.0
    work = work_bound(sum(map(sum, served)), sum(map(sum, training)), cfg)
    g = max(range(len(served)), key=lambda i: max(served[i], default=0.0))
    tail = max(max(training[g], default=0.0), sum(training[g]) / cfg.cells)
    critical = max(served[g]) + tail
    return max(work, critical) + cfg.publish_s
