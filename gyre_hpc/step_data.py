"""What one optimizer step trains on: its prompts, its executions, and the batch made of them.

Pure and deterministic for (seed, step), so a resumed run takes the same data order, and the
same functions serve the runtime, the simulator's replay (``run_id``) and tests. It knows
nothing about cells, MPI or the schedule.

```
 step k ─▶ step_tasks: prompts_per_step tasks ─▶ step_jobs: × group_size executions (run ids)
 finished executions + their TITO trees ─▶ per prompt group (group_sequences):
     group advantages (dropped runs left out, placeholders count as reward 0)
     ─▶ Jmax path selection per trainable run ─▶ weighted sequences ─▶ micro-steps
     all groups at once (step_batch), or each group as it completes (StreamingBatch)
```
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gyre_hpc.agents.dispatch import Outcome
from gyre_hpc.recipe.schema import TasksConfig, TrajectoryConfig
from gyre_hpc.tasks.suites import SUITES, load_suite
from gyre_hpc.tasks.task import Task
from gyre_hpc.trajectory.batch import TrainSequence, build_batch, group_advantages, pack_micro_steps
from gyre_hpc.trajectory.packing import pack_tree_micro_steps, run_chunks
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
    return [(run_id(step, t.id, g), t) for t in tasks for g in range(group_size)]


def run_id(step: int, task_id: str, g: int) -> str:
    """The run of the ``g``-th execution of a task's group in ``step``."""
    return f"s{step:04d}-{task_id}-g{g}"


def dispatched_step(run: str) -> int:
    """The step a ``run_id`` was dispatched for (0 for a run named otherwise, e.g. an evaluation's)."""
    m = re.match(r"s(\d+)-", run)
    return int(m.group(1)) if m else 0


def group_of(outcome: Outcome) -> tuple[int, str]:
    """The group an execution belongs to: (the step it was dispatched for, its task)."""
    return dispatched_step(outcome.execution.run_id), outcome.execution.task_id


@dataclass
class StepBatch:
    queue: list[list[TrainSequence]]
    """Micro-steps, each a list of sequences."""
    num_runs: int
    stats: dict[str, object] = field(default_factory=dict)
    trees: Mapping[str, TrajectoryTree] = field(default_factory=dict)
    """The trees of the step's runs."""


def group_sequences(
    group: Sequence[Outcome],
    trees: Mapping[str, TrajectoryTree],
    trajectory: TrajectoryConfig,
    rng: random.Random,
) -> tuple[list[TrainSequence], int]:
    """One prompt's finished runs → weighted sequences, and how many runs contribute tokens.

    Dropped runs are left out of the group, placeholders count with reward 0 but train nothing;
    a run whose advantage is 0 carries no gradient and is not trained.
    """
    counted = [o for o in group if o.score.counts_in_group]
    adv = group_advantages([o.score.reward or 0.0 for o in counted], trajectory.std_normalize)
    advantages = {o.execution.run_id: a for o, a in zip(counted, adv, strict=True)}
    paths = {
        o.execution.run_id: select_paths(trees[o.execution.run_id], trajectory.jmax, rng, trajectory.priority)
        for o in group
        if o.score.trainable and o.execution.run_id in trees and advantages.get(o.execution.run_id)
    }
    batch = build_batch(paths, advantages)
    return batch.sequences, batch.num_runs


def pack(
    sequences: Sequence[TrainSequence], micro_step_tokens: int, packing: str = "paths"
) -> list[list[TrainSequence]]:
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
    runs = 0
    work = []
    for task_id, group in by_task(outcomes).items():
        seqs, n = group_sequences(group, trees, trajectory, group_rng(seed, step, task_id))
        sequences += seqs
        runs += n
        work.append(group_work(group, trees, seqs, trajectory.packing, micro_step_tokens))
    queue = pack(sequences, micro_step_tokens, trajectory.packing)
    stats = step_stats(outcomes, queue, runs, work, trees.values())
    return StepBatch(queue, runs, stats, trees)


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
        carried: Sequence[list[TrainSequence]] = (),
        pending: dict[tuple[int, str], list[tuple[Outcome, TrajectoryTree | None]]] | None = None,
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
        self.queue: list[list[TrainSequence]] = list(carried)
        """Micro-steps carried from the previous step (``scheduler.carry_tail``) come first."""
        self.num_runs = 0
        self.work: list[dict[str, object]] = []

    def add(self, outcome: Outcome, tree: TrajectoryTree | None) -> list[list[TrainSequence]]:
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
        seqs, n = group_sequences(group, self.trees, self.trajectory, rng)
        self.num_runs += n
        self.work.append(group_work(group, self.trees, seqs, self.trajectory.packing, self.tokens))
        new = pack(seqs, self.tokens, self.trajectory.packing)
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


def step_stats(
    outcomes: Sequence[Outcome],
    queue: list[list[TrainSequence]],
    runs: int,
    work: Sequence[dict[str, object]] = (),
    trees: Iterable[TrajectoryTree] = (),
) -> dict[str, object]:
    counted = [o for o in outcomes if o.score.counts_in_group]
    rewards = [o.score.reward or 0.0 for o in counted]
    sequences = [s for mb in queue for s in mb]
    return {
        "executions": len(outcomes),
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        "pass_rate": sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
        "dropped": len(outcomes) - len(counted),
        "trained_runs": runs,
        "sequences": len(sequences),
        "micro_steps": len(queue),
        "tokens": sum(len(s) for s in sequences),
        "loss_tokens": int(sum(s.loss_mask.sum() for s in sequences)),
        "calls": sum(o.execution.calls for o in outcomes),
        "tool_calls": sum(o.execution.tool_calls for o in outcomes),
        "statuses": dict(sorted(Counter(o.execution.status for o in outcomes).items())),
        "groups": list(work),
        "engine_calls": engine_calls(trees),
        **prefix_reuse(trees),
    }


def engine_calls(trees: Iterable[TrajectoryTree]) -> dict[str, int]:
    """The runs' calls by the engine replica that served them (its URL; the last for a call
    that moved)."""
    return dict(sorted(Counter(r.meta.engine for tree in trees for r in tree.records()).items()))


def prefix_reuse(trees: Iterable[TrajectoryTree]) -> dict[str, int]:
    """The runs' input tokens, and those their engines took from a prefix cache."""
    records = [r for tree in trees for r in tree.records()]
    return {
        "input_tokens": sum(len(r.input_ids) for r in records),
        "cached_tokens": sum(r.meta.cached_tokens for r in records),
    }


def token_staleness(micro_steps: Iterable[list[TrainSequence]], trained_from: int) -> dict[str, int]:
    """Trained tokens by how many versions lie between the one that generated them and the one
    the update trains from (0: on-policy): the micro-steps an update actually trained."""
    count: Counter[int] = Counter()
    for mb in micro_steps:
        for s in mb:
            if s.versions is not None:
                lags, n = np.unique(
                    trained_from - s.versions[np.asarray(s.loss_mask) > 0], return_counts=True
                )
                count.update(dict(zip(lags.tolist(), n.tolist(), strict=True)))
    return {str(k): v for k, v in sorted(count.items())}


def staleness(trees: Iterable[TrajectoryTree], trained_from: int) -> dict[str, int]:
    """Calls by how many versions lie between the one a step trains from and the one that
    served them (0: on-policy); a call that spanned a load counts once for each version of
    its parts."""
    parts = ({v for _, v in r.meta.versions()} for tree in trees for r in tree.records())
    count = Counter(trained_from - v for versions in parts for v in versions)
    return {str(k): v for k, v in sorted(count.items())}
