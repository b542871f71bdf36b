"""What one optimizer step trains on: the batch made of its finished executions.

Pure and deterministic for (seed, step) and whatever order the groups finish in, so the
runtime, a resumed run and tests build the same micro-steps. It knows nothing about cells, MPI,
the schedule or where the executions ran.

```
 finished executions + their TITO trees ─▶ per prompt group (group_sequences):
     group advantages (dropped runs left out, placeholders count as reward 0 or are left out)
     ─▶ Jmax path selection per trainable run ─▶ weighted sequences ─▶ micro-steps
     all groups at once (step_batch), or each group as it completes (StreamingBatch)
```
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gyre_hpc.execution.outcome import Outcome
from gyre_hpc.execution.run_id import dispatched_step
from gyre_hpc.recipe.schema import TrajectoryConfig
from gyre_hpc.step.stats import step_stats
from gyre_hpc.trajectory.packing import pack_tree_micro_steps, run_chunks
from gyre_hpc.trajectory.select import select_paths
from gyre_hpc.trajectory.sequences import (
    Batch,
    StepQueue,
    TrainSequence,
    build_batch,
    group_advantages,
    pack_micro_steps,
)
from gyre_hpc.trajectory.tree import TrajectoryTree

Pending = dict[tuple[int, str], list[tuple[Outcome, TrajectoryTree | None]]]
"""Ended executions (and their trees) of groups not yet complete, by (step dispatched, task)."""


def group_of(outcome: Outcome) -> tuple[int, str]:
    """The group an execution belongs to: (the step it was dispatched for, its task)."""
    return dispatched_step(outcome.execution.run_id), outcome.execution.task_id


@dataclass
class StepBatch:
    queue: StepQueue
    num_runs: int
    divisor: int
    """What the step's summed loss is divided by (``trajectory.sequences.loss_divisor``)."""
    stats: dict[str, object] = field(default_factory=dict)
    trees: Mapping[str, TrajectoryTree] = field(default_factory=dict)
    """The trees of the step's runs."""


def group_sequences(
    group: Sequence[Outcome],
    trees: Mapping[str, TrajectoryTree],
    trajectory: TrajectoryConfig,
    rng: random.Random,
) -> Batch:
    """One prompt's finished runs → weighted sequences, how many runs contribute tokens and the
    loss's divisor.

    Dropped runs are left out of the group, placeholders count with reward 0 (or, with
    ``trajectory.placeholders = "exclude"``, not at all) but train nothing; a run whose advantage
    is 0 carries no gradient and is not trained.
    """
    exclude = trajectory.placeholders == "exclude"
    counted = [
        o for o in group if o.score.counts_in_group and not (exclude and o.score.kind == "placeholder")
    ]
    rewards = [o.score.reward or 0.0 for o in counted]
    adv = group_advantages(rewards, trajectory.std_normalize, baseline=trajectory.baseline)
    advantages = {o.execution.run_id: a for o, a in zip(counted, adv, strict=True)}
    paths = {
        o.execution.run_id: select_paths(trees[o.execution.run_id], trajectory.jmax, rng, trajectory.priority)
        for o in group
        if o.score.trainable and o.execution.run_id in trees and advantages.get(o.execution.run_id)
    }
    return build_batch(paths, advantages, trajectory.loss_mean)


def pack(sequences: Sequence[TrainSequence], micro_step_tokens: int, packing: str = "paths") -> StepQueue:
    """Micro-steps of at most ``micro_step_tokens`` forwarded tokens: unique tokens of each
    micro-step's tree when packing trees, path lengths otherwise."""
    if packing == "tree":
        return pack_tree_micro_steps(sequences, micro_step_tokens)
    bins = pack_micro_steps([len(s) for s in sequences], micro_step_tokens)
    return [[sequences[i] for i in b] for b in bins]


def step_batch(
    outcomes: Sequence[Outcome],
    trees: Mapping[str, TrajectoryTree],
    trajectory: TrajectoryConfig,
    micro_step_tokens: int,
    seed: int,
    step: int,
) -> StepBatch:
    """The whole step at once (colocate, async): groups in order, then one packing."""
    sequences: list[TrainSequence] = []
    runs = divisor = 0
    work = []
    for task_id, group in by_task(outcomes).items():
        batch = group_sequences(group, trees, trajectory, group_rng(seed, step, task_id))
        sequences += batch.sequences
        runs, divisor = runs + batch.num_runs, divisor + batch.divisor
        work.append(group_work(group, trees, batch.sequences, trajectory.packing, micro_step_tokens))
    queue = pack(sequences, micro_step_tokens, trajectory.packing)
    stats = step_stats(outcomes, queue, runs, work, trees.values())
    return StepBatch(queue, runs, divisor, stats, trees)


class StreamingBatch:
    """The step built while it samples (elastic): each prompt's group becomes micro-steps as soon
    as its last run finishes, so training can start before the burst ends."""

    def __init__(
        self,
        group_size: int,
        trajectory: TrajectoryConfig,
        micro_step_tokens: int,
        seed: int,
        step: int,
        carried: StepQueue | tuple[()] = (),
        pending: Pending | None = None,
    ):
        self.group_size, self.trajectory, self.tokens = group_size, trajectory, micro_step_tokens
        self.seed, self.step = seed, step
        self.pending = {} if pending is None else pending
        """Runs (and trees) of groups with runs still to end, by (step dispatched, task): in-flight
        updates pass the same dict to every step, so a group completes, whole, in whichever step
        its last run ends."""
        self.complete = 0
        """Groups this batch completed."""
        self.trees: dict[str, TrajectoryTree] = {}
        """The trees of the runs of the groups this batch completed."""
        self.outcomes: list[Outcome] = []
        """The runs of the groups this batch completed."""
        self.queue: StepQueue = list(carried)
        """Micro-steps carried from the previous step (``scheduler.carry_tail``) come first."""
        self.num_runs = 0
        self.divisor = 0
        """What the summed loss of the groups completed is divided by."""
        self.work: list[dict[str, object]] = []

    def add(self, outcome: Outcome, tree: TrajectoryTree | None) -> StepQueue:
        """Book one finished run (and its complete tree); returns the micro-steps its group
        completed (often none)."""
        key = group_of(outcome)
        runs = self.pending.setdefault(key, [])
        runs.append((outcome, tree))
        if len(runs) < self.group_size:
            return []
        del self.pending[key]
        self.complete += 1
        group = [o for o, _ in runs]
        self.outcomes += group
        self.trees |= {o.execution.run_id: t for o, t in runs if t is not None}
        rng = group_rng(self.seed, key[0], outcome.execution.task_id)
        batch = group_sequences(group, self.trees, self.trajectory, rng)
        self.num_runs += batch.num_runs
        self.divisor += batch.divisor
        self.work.append(group_work(group, self.trees, batch.sequences, self.trajectory.packing, self.tokens))
        new = pack(batch.sequences, self.tokens, self.trajectory.packing)
        self.queue += new
        return new

    def stats(self) -> dict[str, object]:
        return step_stats(self.outcomes, self.queue, self.num_runs, self.work, self.trees.values())


def group_rng(seed: int, step: int, task_id: str) -> random.Random:
    """Selection randomness per group: the same whatever order the groups finish in."""
    return random.Random(f"{seed}-select-{step}-{task_id}")


def by_task(outcomes: Sequence[Outcome]) -> dict[str, list[Outcome]]:
    groups: dict[str, list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault(o.execution.task_id, []).append(o)
    return groups


def group_work(
    group: Sequence[Outcome],
    trees: Mapping[str, TrajectoryTree],
    sequences: Sequence[TrainSequence],
    packing: str = "paths",
    micro_step_tokens: int = 0,
) -> dict[str, object]:
    """What one group cost, independent of timing: the tokens each run generated (sampling work),
    in the order of the sorted run ids, and the tokens of each item it bins into micro-steps
    (training work: a sequence, or with tree packing a run's sequences as one tree). The
    simulator replays these."""
    runs = sorted(o.execution.run_id for o in group)
    return {
        "task": group[0].execution.task_id,
        "step": dispatched_step(runs[0]),
        "run_tokens": [
            sum(len(r.output_ids) for r in trees[run].records()) if run in trees else 0 for run in runs
        ],
        "sequence_tokens": (
            [size for size, _ in run_chunks(sequences, micro_step_tokens)]
            if packing == "tree"
            else [len(s) for s in sequences]
        ),
    }
