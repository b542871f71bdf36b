"""The physical bound of a step: no schedule of the same work on the same cells can be faster.

```
 work      cells · τ ≥ T + (S − pool · τ) / capacity      (a cell either samples or trains)
           ⇒ τ ≥ (S + capacity · T) / (cells · capacity + pool) + publish
 critical  τ ≥ L + max(m, T_g / cells) + publish           (the longest execution, then at least its
                                                            group's training, which cannot start before)
 bound     = max(work, critical)
```

``S``: the step's sampling slot-seconds (every execution's duration plus its overhead), ``T``:
its training cell-seconds, ``L``: its longest execution, ``T_g`` and ``m``: the training of that
execution's group and its longest micro-step. Without a rollout pool the work term is
S / slots + T / cells. A run's bound is the sum over its steps: each step samples with the
weights the previous one published (on-policy), so steps cannot overlap. In-flight weight
updates (``scheduler.max_staleness``) let executions cross steps, so the critical path no longer
binds each step: ``work_bound`` is what is left, the work term alone (and one publication per
step), which no schedule of the whole work beats. Pure: the simulator and ``bench modes`` put
every mode's time over the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

from gyre_hpc.sim.config import SimConfig


def step_bound(
    durations: Sequence[Sequence[float]], training: Sequence[Sequence[float]], cfg: SimConfig
) -> float:
    """The bound of one step whose groups have these execution ``durations`` (served time) and
    yield these micro-steps (``training``: their times on one cell), group by group."""
    served = [[d + cfg.exec_overhead_s for d in group] for group in durations]
    if not any(served):
        return 0.0
    work = work_bound(durations, training, cfg) - cfg.publish_s
    g = max(range(len(served)), key=lambda i: max(served[i], default=0.0))
    tail = max(max(training[g], default=0.0), sum(training[g]) / cfg.cells)
    critical = max(served[g]) + tail
    return max(work, critical) + cfg.publish_s


def work_bound(
    durations: Sequence[Sequence[float]], training: Sequence[Sequence[float]], cfg: SimConfig
) -> float:
    """The step's work spread over every slot and cell, plus its publication."""
    served = [[d + cfg.exec_overhead_s for d in group] for group in durations]
    if not any(served):
        return 0.0
    sampling = sum(map(sum, served))
    train = sum(map(sum, training))
    return (sampling + cfg.capacity * train) / (cfg.cells * cfg.capacity + cfg.pool_capacity) + cfg.publish_s
