"""What one optimizer step trains on: its prompts, its executions, and the batch made of them.

Pure and deterministic for (seed, step), so a resumed run takes the same data order, and the
same functions serve the runtime and tests.

```
 step k ─▶ step_tasks: prompts_per_step tasks ─▶ step_jobs: × group_size executions (run ids)
 finished executions + their TITO trees ─▶ step_batch:
     group advantages per task (dropped runs left out, placeholders count as reward 0)
     ─▶ Jmax path selection per trainable run ─▶ weighted sequences ─▶ micro-steps
```
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gyre_hpc.agents.dispatch import Outcome
from gyre_hpc.recipe.schema import TasksConfig, TrajectoryConfig
from gyre_hpc.tasks.suites import SUITES, load_suite
from gyre_hpc.tasks.task import Task
from gyre_hpc.trajectory.batch import TrainSequence, build_batch, group_advantages, pack_micro_steps
from gyre_hpc.trajectory.select import select_paths
from gyre_hpc.trajectory.tree import TrajectoryTree


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


def step_jobs(tasks: Sequence[Task], group_size: int, step: int) -> list[tuple[str, Task]]:
    return [(f"s{step:04d}-{t.id}-g{g}", t) for t in tasks for g in range(group_size)]


@dataclass
class StepBatch:
    queue: list[list[TrainSequence]]
    """Micro-steps, each a list of sequences."""
    num_runs: int
    stats: dict[str, float] = field(default_factory=dict)


def step_batch(
    outcomes: Sequence[Outcome],
    trees: Mapping[str, TrajectoryTree],
    trajectory: TrajectoryConfig,
    micro_step_tokens: int,
    seed: int,
    step: int,
) -> StepBatch:
    groups: dict[str, list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault(o.execution.task_id, []).append(o)
    advantages: dict[str, float] = {}
    for members in groups.values():
        counted = [o for o in members if o.score.counts_in_group]
        adv = group_advantages([o.score.reward or 0.0 for o in counted], trajectory.std_normalize)
        advantages.update((o.execution.run_id, a) for o, a in zip(counted, adv, strict=True))
    rng = random.Random(f"{seed}-select-{step}")
    paths = {
        o.execution.run_id: select_paths(trees[o.execution.run_id], trajectory.jmax, rng, trajectory.priority)
        for o in outcomes
        if o.score.trainable and o.execution.run_id in trees and advantages.get(o.execution.run_id)
    }
    batch = build_batch(paths, advantages)
    bins = pack_micro_steps([len(s) for s in batch.sequences], micro_step_tokens)
    queue = [[batch.sequences[i] for i in b] for b in bins]
    counted = [o for o in outcomes if o.score.counts_in_group]
    rewards = [o.score.reward or 0.0 for o in counted]
    stats = {
        "executions": len(outcomes),
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        "pass_rate": sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
        "dropped": sum(1 for o in outcomes if not o.score.counts_in_group),
        "trained_runs": batch.num_runs,
        "sequences": len(batch.sequences),
        "micro_steps": len(queue),
        "tokens": sum(len(s) for s in batch.sequences),
        "loss_tokens": int(sum(s.loss_mask.sum() for s in batch.sequences)),
        "calls": sum(o.execution.calls for o in outcomes),
    }
    return StepBatch(queue, batch.num_runs, stats)
