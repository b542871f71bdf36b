"""What a step trains on: deterministic prompts, group advantages, selection, micro-steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gyre_hpc.execution.outcome import Execution, Outcome, ScoreResult
from gyre_hpc.recipe.schema import TasksConfig, TrajectoryConfig
from gyre_hpc.step.batch import step_batch
from gyre_hpc.tasks.data_order import step_jobs, step_tasks
from gyre_hpc.tasks.jsonl import write_jsonl
from gyre_hpc.tasks.task import Task
from gyre_hpc.trajectory.packing import forwarded_tokens
from gyre_hpc.trajectory.records import TitoRecord
from gyre_hpc.trajectory.tree import TrajectoryTree


def test_step_prompts_are_fixed_per_step_and_differ_between_steps() -> None:
    cfg = TasksConfig(suite="smoke", prompts_per_step=3)
    first = [t.id for t in step_tasks(cfg, seed=0, step=1)]
    assert first == [t.id for t in step_tasks(cfg, seed=0, step=1)]  # resume takes the same data
    assert first != [t.id for t in step_tasks(cfg, seed=0, step=2)]
    assert first != [t.id for t in step_tasks(cfg, seed=1, step=1)]


def test_a_jsonl_suite_is_walked_in_seeded_epochs(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "s.jsonl", [Task(id=f"t{i}", spec=f"task {i}") for i in range(5)])
    cfg = TasksConfig(suite=str(tmp_path / "s.jsonl"), prompts_per_step=2)
    seen = [t.id for step in (1, 2, 3, 4, 5) for t in step_tasks(cfg, seed=0, step=step)]
    assert sorted(seen[:5]) == [f"t{i}" for i in range(5)]  # each task once per epoch
    assert sorted(seen[5:10]) == [f"t{i}" for i in range(5)]


def test_group_runs_get_unique_ids() -> None:
    tasks = [Task(id="a", spec=""), Task(id="b", spec="")]
    assert [r for r, _ in step_jobs(tasks, 2, 7)] == ["s0007-a-g0", "s0007-a-g1", "s0007-b-g0", "s0007-b-g1"]


def outcome(run: str, task: str, kind: str, reward: float | None) -> Outcome:
    ex = Execution(run_id=run, task_id=task, workspace=Path("/nowhere"), status="finished", calls=1)
    return Outcome(execution=ex, score=ScoreResult(run_id=run, kind=kind, reward=reward, attempts=1))  # type: ignore[arg-type]


def tree(run: str, prompt: int, out: int) -> TrajectoryTree:
    rec = TitoRecord(run, "call_1", "main", np.arange(prompt), np.arange(out) + 100, -np.ones(out))
    return TrajectoryTree.from_records([rec])


def test_step_batch_advantages_drops_and_packing() -> None:
    outcomes = [
        outcome("a0", "a", "scored", 1.0),
        outcome("a1", "a", "scored", 0.0),
        outcome("a2", "a", "placeholder", 0.0),  # counts in the group, has no tokens to train
        outcome("a3", "a", "dropped", None),  # left out of the group entirely
        outcome("b0", "b", "scored", 0.5),
        outcome("b1", "b", "scored", 0.5),  # equal rewards: advantage 0, nothing to learn
    ]
    trees = {o.execution.run_id: tree(o.execution.run_id, 10, 5) for o in outcomes}
    batch = step_batch(outcomes, trees, TrajectoryConfig(), micro_step_tokens=30, seed=0, step=1)
    runs = sorted(s.run_id for mb in batch.queue for s in mb)
    assert runs == ["a0", "a1"] and batch.num_runs == 2
    adv = {s.run_id: s.advantage for mb in batch.queue for s in mb}
    assert adv == {"a0": 1.0 - 1 / 3, "a1": -1 / 3}  # mean over a0, a1, a2 (placeholder = 0)
    assert [len(mb) for mb in batch.queue] == [2]  # 15 + 15 tokens fit one 30-token micro-step
    assert batch.stats["dropped"] == 1 and batch.stats["pass_rate"] == 1 / 5
    assert all(s.token_weight == 1 / 5 for mb in batch.queue for s in mb)
    assert batch.stats["placeholders"] == 1
    # A placeholder is the infrastructure's failure, not the policy's: excluded, it leaves the
    # group's statistics (a0, a1 alone), and is still counted in the step.
    excluded = step_batch(outcomes, trees, TrajectoryConfig(placeholders="exclude"), 30, seed=0, step=1)
    adv = {s.run_id: s.advantage for mb in excluded.queue for s in mb}
    assert adv == {"a0": 0.5, "a1": -0.5} and excluded.stats["placeholders"] == 1


def test_tree_packing_fills_micro_steps_by_unique_tokens() -> None:
    """Three calls forked from one 40-token context: 150 path tokens, 70 unique."""
    records = [
        TitoRecord("a0", f"call_{i}", "main", np.arange(40), np.arange(10) + 100 * (i + 1), -np.ones(10))
        for i in range(3)
    ]
    outcomes = [outcome("a0", "a", "scored", 1.0), outcome("a1", "a", "scored", 0.0)]
    trees = {"a0": TrajectoryTree.from_records(records), "a1": tree("a1", 5, 5)}
    by = {
        packing: step_batch(outcomes, trees, TrajectoryConfig(packing=packing), 80, seed=0, step=1)
        for packing in ("tree", "paths")
    }
    assert by["paths"].stats["tokens"] == by["tree"].stats["tokens"] == 160
    assert len(by["paths"].queue) == 3  # 160 path tokens, 80 a micro-step
    # one micro-step: 70 unique tokens of a0's tree and a1's 10 (what a trainer of one tree per run forwards)
    assert [forwarded_tokens(mb) for mb in by["tree"].queue] == [70 + 10]
