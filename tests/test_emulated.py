"""Emulated GPUs: the engine's replies are planned and clocked, the trainer's micro-steps are
delays, the coin scorer varies within groups, and a real emulated run replays in the simulator."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from statistics import mean

import pytest
from conftest import gyre

from gyre_hpc.bench.modes import plan, replay_all, step_table, summarize
from gyre_hpc.bench.replay import observed, replay, run_tokens
from gyre_hpc.bench.sim import speedups
from gyre_hpc.builtin_models.resolve import resolve_model
from gyre_hpc.engines.emulated import EmulatedEngine, planned_tokens
from gyre_hpc.engines.sampling import SamplingParams
from gyre_hpc.observability.events import read_events
from gyre_hpc.proxy.chat import parse_reply
from gyre_hpc.recipe import load_recipe
from gyre_hpc.recipe.schema import ScoringConfig
from gyre_hpc.rundir import RunDir
from gyre_hpc.scoring.builtin import CoinScorer
from gyre_hpc.scoring.contract import RunArtifacts
from gyre_hpc.sim.simulate import simulate

DECODE_S = 0.01


@pytest.fixture(scope="module")
def engine():
    e = EmulatedEngine(resolve_model("tiny"), decode_s=DECODE_S, tokens_median=40, tokens_sigma=0.5).start()
    yield e
    e.stop()


def generate(engine: EmulatedEngine, input_ids: list[int], **params) -> tuple[dict, float]:
    done: dict = {}
    event = threading.Event()
    started = time.monotonic()
    engine.submit(
        input_ids,
        SamplingParams.from_request(params),
        lambda r: (done.update(r), event.set()),
    )
    assert event.wait(30)
    return done, time.monotonic() - started


def test_a_reply_is_its_planned_length_clocked_at_the_decode_time(engine: EmulatedEngine) -> None:
    for seed in (1, 2, 3):
        n = planned_tokens(seed, 40, 0.5)
        reply, seconds = generate(engine, [5, 6, 7], max_new_tokens=500, sampling_seed=seed)
        assert reply["meta_info"]["completion_tokens"] == n
        assert seconds >= (n - 1) * DECODE_S  # one token per tick, whatever the batch
        _, calls = parse_reply(reply["text"], "c")
        assert [c["function"]["name"] for c in calls] == ["finish"]  # one call ends the execution


def test_max_new_tokens_cuts_the_reply_like_a_timeout(engine: EmulatedEngine) -> None:
    reply, _ = generate(engine, [5, 6, 7], max_new_tokens=3, sampling_seed=2)
    assert reply["meta_info"]["completion_tokens"] == 3
    assert reply["meta_info"]["finish_reason"]["type"] == "length"


def test_a_call_continued_elsewhere_resumes_the_same_plan(engine: EmulatedEngine) -> None:
    whole, _ = generate(engine, [5, 6, 7], max_new_tokens=500, sampling_seed=4)
    head, _ = generate(engine, [5, 6, 7], max_new_tokens=10, sampling_seed=4)
    rest, _ = generate(engine, [5, 6, 7, *head["output_ids"]], max_new_tokens=490, sampling_seed=4)
    assert head["output_ids"] + rest["output_ids"] == whole["output_ids"]


def test_the_coin_differs_within_groups_and_never_changes() -> None:
    coin = CoinScorer(ScoringConfig())
    groups = [[f"s0001-emulated-1-{t}-g{g}" for g in range(4)] for t in range(16)]
    rewards = [[coin.score(RunArtifacts(r, Path("."), "finished")) for r in g] for g in groups]
    assert sum(len(set(g)) > 1 for g in rewards) >= 10  # most groups have an advantage to train
    assert rewards == [[coin.score(RunArtifacts(r, Path("."), "finished")) for r in g] for g in groups]


def test_bench_modes_plans_every_async_split_or_the_recipe_s_and_ours() -> None:
    every = load_recipe("recipes/emulated.toml", ["cells.count=3", 'bench.modes=["elastic", "async"]'])
    assert list(plan(every, ours=True)) == [
        "elastic", "async 1/3", "async 2/3", "elastic+carry", "in-flight k=1", "in-flight k=2",
    ]  # fmt: skip
    assert plan(every, ours=False)["async 2/3"] == ["scheduler.mode=async", "scheduler.async_train_cells=2"]
    one = load_recipe("recipes/emulated.toml", ["cells.count=3", "bench.async_splits=[2]"])
    assert [name for name in plan(one, ours=False) if name.startswith("async")] == ["async 2/3"]


RECORDED = Path(__file__).parent / "fixtures" / "emulated"
"""Four real emulated runs of 2 steps (elastic, its best async split, ``carry_tail``, in-flight
k = 1), as the replay reads them (``fixtures/emulated/README.md`` has the command)."""


def replays_alike(run_dir: Path) -> None:
    """Replayed with the costs measured in it, a recorded run makes the same role switches, in the
    same order, in the simulator, and its steps take as long (within 15 %)."""
    cfg, workload = replay(run_dir)
    simulated = simulate(cfg, RunDir(run_dir).read_recipe().scheduler.mode, workload)
    real = observed(run_dir)
    assert simulated.switch_log == real.switch_log, run_dir.name
    assert mean(simulated.step_times[1:]) == pytest.approx(mean(real.step_times[1:]), rel=0.15), run_dir.name


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_bench_modes_runs_a_mode_and_the_simulator_makes_the_same_switches(tmp_path: Path) -> None:
    """``bench modes`` end to end on one live emulated run (every split and ours are planned
    above, and the recorded runs below replay each mode): its table against the simulator's replay
    and the bounds, its plots, and the same switches in the simulator."""
    proc = gyre(
        "bench", "modes", "recipes/emulated.toml",
        "--steps", "2", "--cells", "3", "--out", str(tmp_path),
        "--set", "tasks.prompts_per_step=3",
        "--set", "engine.emulated_tokens_median=60",
        "--set", 'bench.modes=["elastic"]',
        timeout=800,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "simulated / real" in proc.stdout and "real / bound" in proc.stdout
    runs = tmp_path / "runs"
    assert [p.name for p in runs.iterdir()] == ["elastic"]
    for kind in ("real", "simulated"):
        assert {"step_times.png", "gantt_elastic.png", "time_split.png"} <= {
            p.name for p in (tmp_path / kind).iterdir()
        }
    run_dir = next((runs / "elastic").iterdir())
    replays_alike(run_dir)
    assert observed(run_dir).switch_log  # elastic switched while it ran


@pytest.mark.parametrize("mode", ["elastic", "elastic+carry", "in-flight-k=1", "async-2of3"])
def test_each_recorded_mode_replays_with_the_same_switches(mode: str) -> None:
    replays_alike(RECORDED / mode)
    assert observed(RECORDED / mode).switch_log or mode.startswith("async")


def test_the_modes_table_sets_each_real_step_beside_its_replay_and_names_the_best_async() -> None:
    runs = {
        name: RunDir(RECORDED / name) for name in ("elastic", "async-2of3", "elastic+carry", "in-flight-k=1")
    }
    table = step_table("recorded", runs, replay_all(runs))
    assert "simulated / real" in table.columns and "real / on-policy bound" in table.columns
    rows = {row[0]: dict(zip(table.columns, row, strict=True)) for row in table.rows}
    assert set(rows) == {"elastic", "async-2of3 (best async)", "elastic+carry", "in-flight-k=1"}
    assert all(0.85 <= float(r["simulated / real"]) <= 1.15 for r in rows.values())
    step_s = {name: summarize(rd)["step_s"] for name, rd in runs.items()}
    lines = speedups(step_s)
    assert any("vs the best async (async-2of3" in line for line in lines)
    assert any("vs the paper's elastic rule" in line for line in lines)


def test_a_carried_tail_leads_the_next_step_and_the_recorded_workload_replays() -> None:
    run_dir = RECORDED / "elastic+carry"
    events = read_events(run_dir / "events.jsonl")
    steps = [e for e in events if e.kind == "step"]
    assert [s.version for s in steps] == [1, 2]
    assert all(s.statuses == {"finished": 12} and s.calls == 12 for s in steps)
    # What one step leaves is what the next one starts with; the last step leaves nothing.
    assert [s.carried_in for s in steps[1:]] == [s.carried_out for s in steps[:-1]]
    assert steps[-1].carried_out == 0 and any(s.carried_out for s in steps)
    assert [e.stop for e in events if e.kind == "burst_end"][-1] is False
    # The recorded workload replays: durations are tokens × decode time, one step per step.
    cfg, workload = replay(run_dir)
    assert (cfg.cells, cfg.capacity, cfg.steps, cfg.carry_tail) == (3, 4, 2, True)
    tokens = run_tokens(steps)
    assert sorted(d for g in workload(1) for d in g.durations) == sorted(
        t * 0.02 for r, t in tokens.items() if r.startswith("s0001")
    )
