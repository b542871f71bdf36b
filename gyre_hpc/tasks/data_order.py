"""The data order: which prompts each optimizer step samples, and its executions' run ids.

Pure and deterministic for (seed, step), so a resumed run takes the same data order, and the
same functions serve the runtime and tests. It knows nothing about batching or the schedule.

```
 step k ─▶ step_tasks: prompts_per_step tasks ─▶ step_jobs: × group_size executions (run ids)
```
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from gyre_hpc.execution.run_id import run_id
from gyre_hpc.recipe.schema import TasksConfig
from gyre_hpc.tasks.suites import SUITES, load_suite
from gyre_hpc.tasks.task import Task


def step_tasks(tasks: TasksConfig, seed: int, step: int) -> list[Task]:
    """The prompts of ``step`` (1-based): new built-in tasks per step, or a seeded walk of a JSONL suite."""
    n = tasks.prompts_per_step
    if tasks.suite in SUITES:
        return load_suite(tasks.suite, n, seed=seed * 10_007 + step, split="train")
    pool = load_suite(tasks.suite, 0, seed=seed)
    out: list[Task] = []
    at = (step - 1) * n
    while len(out) < n:
        epoch, i = divmod(at, len(pool))
        order = list(range(len(pool)))
        random.Random(f"{seed}-epoch-{epoch}").shuffle(order)
        out.append(pool[order[i]])
        at += 1
    return out


@dataclass(frozen=True)
class DataOrder:
    """A run's data order as the step kinds take it (``scheduler.steps.Jobs``)."""

    tasks: TasksConfig
    seed: int

    def jobs(self, step: int, prompts: int | None = None) -> list[tuple[str, Task]]:
        """The executions of ``step``'s first ``prompts`` prompts (all of them when None)."""
        return step_jobs(step_tasks(self.tasks, self.seed, step)[:prompts], self.tasks.group_size, step)


def step_jobs(tasks: Sequence[Task], group_size: int, step: int) -> list[tuple[str, Task]]:
    return [(run_id(step, t.id, g), t) for t in tasks for g in range(group_size)]
