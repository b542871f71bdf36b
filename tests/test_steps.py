"""The step kinds over a scripted workload, on the simulator's fleet: their switches, their queues
and their boundaries, with no MPI and no wall-clock time.

The workload: 3 cells of 4 (12 concurrent executions), 3 prompts × 4 runs per step. Prompt 0's
runs end at t = 1, prompt 1's at 2–3, prompt 2's at 4–9 (the long tail); rewards alternate
within each group, so every run trains one micro-step (13 tokens, 0.26 s).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from sampler_fake import FakeSampler

from gyre_hpc.loss.token_stats import TokenStats
from gyre_hpc.observability import events as ev
from gyre_hpc.recipe.schema import RunConfig, SchedulerConfig, TasksConfig, TrainerConfig, TrajectoryConfig
from gyre_hpc.rundir import RunDir
from gyre_hpc.scheduler.policy import initial_roles
from gyre_hpc.scheduler.steps import StepContext, step_event, step_kind
from gyre_hpc.sim.config import SimConfig
from gyre_hpc.sim.fleet import Clock, SimFleet
from gyre_hpc.tasks.data_order import DataOrder

DURATIONS = [[1, 1, 1, 1], [2, 2, 2, 3], [4, 4, 5, 9]]  # per prompt, per run of its group
S, T = "sampling", "training"


def duration(run: str) -> float:
    prompt, g = map(int, re.fullmatch(r"s\d+-emulated-\d+-(\d+)-g(\d+)", run).groups())
    return DURATIONS[prompt][g]


def reward(run: str) -> float:
    return float(run.endswith(("g0", "g2")))


FLEET = SimConfig(
    cells=3,
    capacity=4,
    switch_to_train_s=0.2,
    switch_to_sample_s=0.2,
    load_s=0.1,
    publish_s=0.3,
    train_s_per_token=0.02,
)
"""3 cells of 4; a switch takes 0.2 s, a load 0.1 s, an apply 0.3 s, a token 0.02 s to train."""


def run_steps(tmp_path: Path, mode: str, steps: int = 2, **sched: object):
    clock = Clock()
    scheduler = SchedulerConfig(mode=mode, **sched)  # type: ignore[arg-type]
    fleet = SimFleet(clock, FLEET, initial_roles(mode, 3, scheduler.async_train_cells))
    run_dir = RunDir.create(tmp_path, mode)
    sampler = FakeSampler(clock, lambda: fleet.version, duration, reward, run_dir.tito_log)
    tasks = TasksConfig(suite="emulated", group_size=4, prompts_per_step=3)
    ctx = StepContext(
        fleet=fleet,
        sampler=sampler,
        events=ev.EventLog(run_dir.events),
        run_dir=run_dir,
        data=DataOrder(tasks, 0),
        run=RunConfig(steps=steps),
        scheduler=scheduler,
        tasks=tasks,
        trajectory=TrajectoryConfig(),
        trainer=TrainerConfig(micro_step_tokens=16, checkpoint_every=0),
        clock=clock,
    )
    kind = step_kind(scheduler)(ctx)
    records = [step_event(kind.run(step), clock.now, fleet.roles) for step in range(1, steps + 1)]
    return fleet, records, run_dir.read_events()


def switches(events: list[ev.Event], step: int) -> list[tuple[int, str]]:
    return [
        (e.cell, e.direction.split("→")[1]) for e in events if isinstance(e, ev.Switch) and e.step == step
    ]


def test_elastic_cells_join_by_the_water_level_and_leave_last_first(tmp_path: Path) -> None:
    started = time.monotonic()
    fleet, steps, events = run_steps(tmp_path, "elastic")
    for step in (1, 2):
        assert switches(events, step) == [(0, T), (1, T), (2, T), (2, S), (1, S), (0, S)]
    joined = [e for e in events if isinstance(e, ev.Switch) and e.direction == "sampling→training"]
    # The core leaves once prompt 0 has ended (w = 8 ≤ C_R − C_0 = 8), cell 1 once prompt 1 has
    # (w = 4 ≤ 8 − 4), cell 2 only when the burst is over (C_R − C_2 = 0 leaves nobody serving).
    assert [e.w for e in joined[:3]] == [8, 4, 0]
    for s in steps:
        assert s.micro_steps == 12 and sum(s.claims.values()) == 12 and s.trained_runs == 12
        assert s.train_before_burst_end_s and s.train_before_burst_end_s > 0  # training overlapped sampling
        assert s.roles == {"0": S, "1": S, "2": S}  # every step ends with every cell sampling
    assert [a[1] for a in fleet.applied] == [list(range(12))] * 2  # each micro-step trained once
    assert [s.version for s in steps] == [1, 2] and steps[1].staleness == {"0": 12}
    assert [s["tito_bytes"] for s in fleet.states] == [{"tito.bin": 12}, {"tito.bin": 24}]
    assert time.monotonic() - started < 10


def test_colocate_trains_on_every_cell_after_the_burst_and_returns_them_together(tmp_path: Path) -> None:
    fleet, steps, events = run_steps(tmp_path, "colocate")
    for step in (1, 2):
        assert switches(events, step) == [(0, T), (1, T), (2, T), (0, S), (1, S), (2, S)]
    first = [t for t, _, role in fleet.switches if role == T][:3]
    assert min(first) >= 9  # nobody trains before the burst's last execution ends
    for s in steps:
        assert s.train_before_burst_end_s is None and s.sample_seconds == pytest.approx(9, abs=1)
        assert sum(s.claims.values()) == s.micro_steps == 12 and set(s.claims) == {"0", "1", "2"}
    assert [s.version for s in steps] == [1, 2]


def test_async_keeps_its_split_and_samples_the_next_burst_while_it_trains(tmp_path: Path) -> None:
    fleet, steps, events = run_steps(tmp_path, "async", steps=3, async_train_cells=1)
    assert [e for e in events if isinstance(e, ev.Switch)] == []  # a fixed split: no switch at all
    assert fleet.switches == []
    for s in steps:
        assert s.claims == {"0": 12} and s.roles == {"0": T, "1": S, "2": S}
    # Burst k+1 was dispatched when burst k ended, so it was served one version behind.
    assert steps[0].staleness == {"0": 12}
    assert steps[1].staleness == {"1": 12} and steps[2].staleness == {"1": 12}
    # The same in trained tokens: every token the update trained was generated one version behind.
    assert set(steps[0].staleness_tokens) == {"0"} and steps[0].staleness_tokens["0"] > 0
    assert [set(s.staleness_tokens) for s in steps[1:]] == [{"1"}, {"1"}]
    # A checkpoint keeps the log up to its burst's end, though the next burst's first calls
    # (ending 1 s into it) were logged before the step was applied: a resumed run redoes them.
    assert [s["tito_bytes"]["tito.bin"] for s in fleet.states] == [12, 24, 36]
    # Training (3.1 s on one cell) hides behind the next burst: a step lasts one burst (9 s).
    assert steps[1].seconds == pytest.approx(9, abs=0.01) and steps[2].seconds == pytest.approx(9, abs=0.01)


def test_carry_tail_applies_at_the_burst_s_end_and_leads_the_next_queue(tmp_path: Path) -> None:
    fleet, steps, events = run_steps(tmp_path, "elastic", steps=3, carry_tail=True)
    stops = [e.stop for e in events if isinstance(e, ev.BurstEnd)]
    assert stops[0] and not stops[-1]  # the tail is carried, except on the last step
    assert steps[0].carried_out > 0 and steps[-1].carried_out == 0
    assert [s.carried_in for s in steps[1:]] == [s.carried_out for s in steps[:-1]]
    for s, (_, trained, _) in zip(steps, fleet.applied, strict=True):
        assert set(range(s.carried_in)) <= set(trained)  # carried work is trained where it lands
    assert sum(len(trained) for _, trained, _ in fleet.applied) == 36  # every micro-step once


def test_a_step_with_nothing_to_learn_is_applied_without_training(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(__import__(__name__), "reward", lambda run: 1.0)
    for mode in ("elastic", "colocate"):
        fleet, steps, events = run_steps(tmp_path / mode, mode, steps=1)
        assert steps[0].skipped and steps[0].version == 0 and steps[0].micro_steps == 0
        assert switches(events, 1) == [] and fleet.applied == [(1, [], 0)]


@pytest.mark.parametrize("k", [1, 2])
def test_in_flight_steps_close_at_their_quota_and_train_every_execution_once(tmp_path: Path, k: int) -> None:
    fleet, steps, events = run_steps(tmp_path, "elastic", steps=4, max_staleness=k, lookahead=0.34)
    # Step 1 closes once 3 groups are in (step 2's first two prompts ran ahead), not at its 9 s run.
    assert steps[0].sample_seconds < 9
    # Every group dispatched (3 prompts × 4 steps) lands in exactly one step.
    landed = [(g["step"], g["task"]) for s in steps for g in s.groups]
    assert len(landed) == len(set(landed)) == 12
    assert sorted({step for step, _ in landed}) == [1, 2, 3, 4]
    assert sum(s.executions for s in steps) == 48
    # ... whole: a group whose runs ended in two steps trains every run, with its tree.
    assert sum(s.trained_runs for s in steps) == 48
    assert all(tokens == 10 for s in steps for g in s.groups for tokens in g["run_tokens"])
    assert any(step < s.step for s in steps for step in {g["step"] for g in s.groups})  # crossed a version
    # No trained token is more than k versions behind the update that trains it.
    for s in steps:
        assert all(int(lag) <= k for lag in s.staleness_tokens)
    assert any(int(lag) > 0 for s in steps for lag in s.staleness_tokens)
    # Only the staleness rule ends an execution early, and each one it ends is trained.
    stopped = [run for e in events if isinstance(e, ev.StaleStopped) for run in e.runs]
    assert sum(s.statuses.get("stopped", 0) for s in steps) == len(stopped)
    if k == 1:
        assert stopped  # a long run dispatched ahead cannot wait for two more versions
    # The run's last step is a barrier: nothing is left running, and every cell samples again.
    assert steps[-1].roles == {"0": S, "1": S, "2": S}
    assert [s.version for s in steps] == [1, 2, 3, 4]


def test_runs_plot_side_by_side_with_their_off_policy_share(tmp_path: Path) -> None:
    run_steps(tmp_path / "barrier", "elastic", steps=2)
    run_steps(tmp_path / "k1", "elastic", steps=3, max_staleness=1, lookahead=0.34)
    runs = [f"{name}={next((tmp_path / name).iterdir())}" for name in ("barrier", "k1")]
    tool = [sys.executable, str(REPO / "tools" / "plot_learning.py")]
    out = tmp_path / "learning.png"
    proc = subprocess.run([*tool, *runs, "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 10_000
    bad = subprocess.run([*tool, "nolabel"], capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stderr.strip() == (
        "error: nolabel: expected LABEL=RUN_DIR, a directory with events.jsonl"
    )


def test_the_step_reports_the_tokens_its_trainers_forwarded() -> None:
    """The trainers' own count (``TrainDone.tokens``): the torch trainer forwards a micro-step as
    one forest, so two runs with the same 30-token path forward 30 tokens, not a tree each (60)."""
    from gyre_hpc.runtime.protocol import StepApplied, TrainDone
    from gyre_hpc.scheduler.steps import StepRecord

    done = {
        0: TrainDone(cell=0, step=1, claimed=[0], loss_sum=0.0, tokens=30, stats=TokenStats(), seconds=1.0),
        1: TrainDone(cell=1, step=1, claimed=[], loss_sum=0.0, tokens=0, stats=TokenStats(), seconds=0.0),
    }
    applied = StepApplied(step=1, version=1, grad_norm=0.0, seconds=0.0, checkpoint="")
    record = StepRecord(
        step=1,
        started=0.0,
        sampled=1.0,
        stats={"executions": 2, "tokens": 60},
        loss_divisor=2,
        done=done,
        applied=applied,
        skipped=False,
        staleness={},
        switches=[],
    )
    event = step_event(record, 2.0, {})
    assert (event.tokens, event.forwarded_tokens) == (60, 30)
