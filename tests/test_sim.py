"""The simulator drives the runtime's policy; its runs keep the same invariants as the runtime."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from conftest import gyre
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_hpc.bench.replay import measured_costs, uncontended_dispatches
from gyre_hpc.observability import events as ev
from gyre_hpc.recipe.schema import CellsConfig
from gyre_hpc.scheduler.policy import Role
from gyre_hpc.scheduler.steps import StepRecord
from gyre_hpc.sim.bound import run_bound, step_bound, work_bound
from gyre_hpc.sim.config import CONFIGS, SimConfig, ablations, variants
from gyre_hpc.sim.simulate import PromptGroup, SimResult, Simulation, Workload, sampled, simulate

LONG_TAIL = SimConfig(cells=4, capacity=8, prompts=8, group_size=4, steps=5, duration_sigma=1.0)
PAPER = {
    "paper-2.4t": CONFIGS["paper-2.4t"].with_(steps=12),
    "paper-122b": CONFIGS["paper-122b"].with_(steps=4),
}
"""The paper regimes at a length the tests can afford (122B: 16 cells, 15 async splits)."""


@functools.cache
def paper_run(cfg: SimConfig, mode: str) -> SimResult:
    """A paper regime's simulation, once for the module: several tests compare the same runs."""
    return simulate(cfg, mode)


def trained(record: StepRecord) -> set[int]:
    """The micro-steps (queue indices) a step's cells trained."""
    return {i for d in record.done.values() for i in d.claimed}


@pytest.mark.parametrize("mode", ["elastic", "async", "colocate"])
def test_every_step_trains_all_its_micro_steps(mode: str) -> None:
    sim = Simulation(LONG_TAIL, mode)
    result = sim.run()
    assert len(result.step_ends) == LONG_TAIL.steps
    assert result.step_ends == sorted(result.step_ends)
    for step, record in enumerate(sim.records, 1):  # nothing left untrained, nothing trained twice
        given = sum(len(g.micro_steps) for g in sim.data.groups[step])
        assert sorted(trained(record)) == list(range(given)) == list(range(record.stats["micro_steps"]))
    for cell in result.cells:  # cell time adds up to the run's length
        assert abs(cell.total - result.total_s) < 1e-6


def test_modes_behave_as_their_rules_say() -> None:
    elastic, asyn, colocate = (simulate(LONG_TAIL, m) for m in ("elastic", "async", "colocate"))
    assert asyn.switches == 0  # a fixed split
    assert colocate.switches % LONG_TAIL.cells == 0  # all cells switch together
    assert elastic.total_s < colocate.total_s  # training overlaps the burst's long tail


@pytest.mark.parametrize("name", ["paper-2.4t", "paper-122b"])
def test_elastic_is_at_least_as_fast_as_the_best_async_split_and_faster_than_colocate(name: str) -> None:
    cfg = PAPER[name]
    times = {n: paper_run(c, mode).total_s for n, (mode, c) in variants(cfg).items()}
    best = min(t for n, t in times.items() if n.startswith("async"))
    assert len([n for n in times if n.startswith("async")]) == cfg.cells - 1  # every split was run
    assert times["elastic"] <= best * 1.02  # against the best-tuned baseline, within noise
    assert times["elastic"] < times["colocate"]


def test_steps_follow_the_boundary_rules() -> None:
    """Trainers join in switch order while a step runs and leave last first once it has closed,
    before the next burst: every step starts and ends with every cell sampling."""
    sim = Simulation(LONG_TAIL, "elastic")
    result = sim.run()
    for step in range(1, LONG_TAIL.steps + 1):
        log = [(cell, role) for s, cell, role in result.switch_log if s == step]
        k = len(log) // 2
        assert log[:k] == [(c, "training") for c in range(k)] and log[k:] == [
            (c, "sampling") for c in reversed(range(k))
        ]
    assert list(sim.fleet.roles.values()) == [Role.SAMPLING] * LONG_TAIL.cells
    colocate = simulate(LONG_TAIL, "colocate")
    for step in range(1, LONG_TAIL.steps + 1):
        roles = [role for s, _, role in colocate.switch_log if s == step]
        assert roles == ["training"] * LONG_TAIL.cells + ["sampling"] * LONG_TAIL.cells


@pytest.mark.parametrize(
    "mode, changes",
    [("elastic", {}), ("colocate", {}), ("async", {}), ("elastic", {"carry_tail": True}),
     ("elastic", {"max_staleness": 1}), ("elastic", {"max_staleness": 2, "lookahead": 1.0})],
)  # fmt: skip
def test_every_mode_s_switch_log_follows_its_rules(mode: str, changes: dict) -> None:
    """The runtime's step kinds on the simulated fleet, in well under a second each: async never
    switches; colocate sends every cell at once and brings every cell back; the elastic kinds
    send cells in switch order, bring them back last first, and end each step all sampling."""
    cfg = LONG_TAIL.with_(**changes)
    r = simulate(cfg, mode)
    assert len(r.step_ends) == cfg.steps
    for step in range(1, cfg.steps + 1):
        log = [(cell, role) for s, cell, role in r.switch_log if s == step]
        if mode == "async":
            assert log == []
            continue
        k = len(log) // 2
        assert log[:k] == [(c, "training") for c in range(k)], (step, log)
        if mode == "colocate":  # all at once, in one switch
            assert sorted(log[k:]) == [(c, "sampling") for c in range(cfg.cells)] and k == cfg.cells
        else:
            assert log[k:] == [(c, "sampling") for c in reversed(range(k))], (step, log)


def test_bench_sim_prints_ratios_and_plots(tmp_path: Path) -> None:
    proc = gyre("bench", "sim", "--config", "smoke", "--set", "steps=3", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "vs the best async (async " in proc.stdout and "vs colocate" in proc.stdout
    assert "total / bound" in proc.stdout and "idle slots" in proc.stdout and "h a step" in proc.stdout
    assert {p.name for p in tmp_path.iterdir()} >= {"step_times.png", "gantt_elastic.png", "time_split.png"}
    bad = gyre("bench", "sim", "--set", "cels=3")
    assert (
        bad.returncode == 2
        and "unknown simulator key (did you mean cells?); valid keys: cells = 4" in bad.stderr
    )
    bad = gyre("bench", "sim", "--set", "cells=0")
    assert bad.returncode == 2 and "cells = 0; valid: 1 or more" in bad.stderr


def test_carry_tail_beats_the_paper_rule_in_both_paper_regimes() -> None:
    for name, cfg in PAPER.items():
        paper = paper_run(cfg, "elastic")
        ours = paper_run(cfg.with_(carry_tail=True), "elastic")
        assert ours.total_s < paper.total_s * 0.99, name  # the last step still trains its whole tail


def test_carried_work_is_trained_once_and_never_carried_twice() -> None:
    cfg = LONG_TAIL.with_(carry_tail=True, steps=8)
    sim = Simulation(cfg, "elastic")
    sim.run()
    records = sim.records
    assert any(r.carried_out for r in records)  # some step was applied at its burst's end
    assert records[-1].carried_out == 0  # the last step trains its whole tail
    given = sum(len(g.micro_steps) for s in range(1, cfg.steps + 1) for g in sim.data.groups[s])
    assert sum(len(trained(r)) for r in records) == given  # each micro-step trained once
    for r in records:
        if r.carried_out:  # a step that carried its tail had trained all it was handed
            assert set(range(r.carried_in)) <= trained(r)


def test_ablations_go_the_paper_s_way() -> None:
    ratio = {}
    for name, ((m0, c0), (m1, c1)) in ablations(PAPER["paper-2.4t"]).items():
        ratio[name] = paper_run(c0, m0).total_s / paper_run(c1, m1).total_s
    assert 0.95 <= ratio["half as many cells, twice as large"] <= 1.0


def test_bench_sim_reports_ours_and_the_ablations(tmp_path: Path) -> None:
    proc = gyre(
        "bench", "sim", "--config", "smoke", "--set", "steps=3", "--ablations", "--out", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    assert "vs the paper's elastic rule" in proc.stdout and "ablations" in proc.stdout
    bad = gyre("bench", "sim", "--set", "lookahead=2")
    assert bad.returncode == 2 and "lookahead = 2.0; valid: 0 to 1" in bad.stderr


def test_a_step_bound_is_its_work_or_its_critical_path() -> None:
    cfg = SimConfig(cells=2, capacity=4, pool_capacity=0, publish_s=1.0, exec_overhead_s=0.0)
    # 8 executions of 10 s (80 slot-s over 8 slots) and 8 s of training over 2 cells: work 14 s
    assert step_bound([[10.0] * 4, [10.0] * 4], [[2.0, 2.0], [2.0, 2.0]], cfg) == 10 + 4 + 1
    # one 100 s execution, then its group's 6 s of training (3 s over 2 cells; a 5 s micro-step)
    assert step_bound([[100.0, 1.0], [1.0]], [[5.0, 1.0], [1.0]], cfg) == 100 + 5 + 1
    # a rollout pool adds slots but never trains: (S + capacity · T) / (cells · capacity + pool)
    pooled = cfg.with_(pool_capacity=8)
    assert step_bound([[10.0] * 8] * 3, [[2.0, 2.0]] * 3, pooled) == (240 + 4 * 12) / 16 + 1
    # the run's bound counts one publication, the last, whatever the number of steps
    assert run_bound([work_bound(80.0, 8.0, cfg)] * 3, cfg) == 3 * 14 + 1


def one_outlier(cfg: SimConfig, times: float, steps: range | None = None) -> Workload:
    """The config's workload with the first execution of each of ``steps`` (every step when
    None) ``times`` the median."""
    base = sampled(cfg)

    def groups(step: int) -> list[PromptGroup]:
        first, *rest = base(step)
        if steps is not None and step not in steps:
            return [first, *rest]
        outlier = (cfg.duration_median_s * times, *first.durations[1:])
        return [PromptGroup(outlier, first.micro_steps), *rest]

    return groups


MODES = {
    "colocate": ("colocate", {}),
    "async": ("async", {"async_train_cells": 1}),
    "elastic": ("elastic", {}),
    "carry_tail": ("elastic", {"carry_tail": True}),
    "in-flight": ("elastic", {}),  # k > 0 from the regime
}


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4), st.integers(1, 6), st.sampled_from([0, 4]), st.integers(1, 4), st.integers(1, 4),
    st.floats(0.3, 2.0), st.floats(0.5, 20.0), st.floats(0.1, 5.0), st.floats(0.1, 120.0),
    st.floats(0.0, 1.0), st.integers(1, 3), st.sampled_from([0, 2]), st.booleans(), st.integers(0, 10**6),
)  # fmt: skip
def test_no_mode_finishes_below_the_bound_with_and_without_stops(
    cells: int, capacity: int, pool: int, prompts: int, group_size: int, sigma: float, train_s: float,
    micro_step_s: float, publish_s: float, ahead: float, k: int, checkpoint_every: int, outlier: bool,
    seed: int,
) -> None:  # fmt: skip
    """Heavy tails, one execution 50× the median, groups of one (which train nothing) to four,
    publication from 0.1 s to 120 s, look-ahead 0 to 1, k 0 to 3, pools and checkpoints: every
    mode runs to its end, and takes at least the work it was served and trained plus the last
    publication; steps in series also their on-policy bound."""
    cfg = SimConfig(
        cells=cells, capacity=capacity, pool_capacity=pool, prompts=prompts, group_size=group_size,
        steps=4, duration_sigma=sigma, train_s_per_exec=train_s, micro_step_s=micro_step_s,
        publish_s=publish_s, lookahead=ahead, checkpoint_every=checkpoint_every, timeout_s=1e9, seed=seed,
    )  # fmt: skip
    workload = one_outlier(cfg, 50.0) if outlier else None
    for name, (mode, changes) in MODES.items():
        if mode == "async" and cells < 2 and not pool:
            continue
        c = cfg.with_(**changes, max_staleness=k if name == "in-flight" else 0)
        sim = Simulation(c, mode, workload)
        r = sim.run()
        stopped = sim.sampler.stopped
        assert len(r.work_bounds) == cfg.steps and r.total_s >= r.bound_s * (1 - 1e-9), (name, stopped)
        if r.step_bound_s is not None:
            assert r.total_s >= r.step_bound_s * (1 - 1e-9), name
        for cell in r.cells:
            assert cell.idle_slots >= 0 and cell.sampling >= -1e-9  # busy: sampling less its idle slots


def test_a_burst_whose_last_execution_ends_during_a_switch_closes_its_queue() -> None:
    """The last execution ends while a cell switches to training: the step takes it (and closes
    its queue) before it waits for a trainer, instead of waiting on a fleet with nothing left to
    happen (the loop before ``StreamingStep.await_report`` raised here)."""
    cfg = SimConfig(
        cells=3, capacity=2, prompts=2, group_size=3, steps=1, train_s_per_exec=0.5, micro_step_s=0.5, seed=1
    )
    for mode, changes in (
        ("elastic", {}),
        ("elastic", {"carry_tail": True}),
        ("elastic", {"max_staleness": 1}),
    ):
        r = simulate(cfg.with_(**changes, checkpoint_every=2), mode)
        assert len(r.step_ends) == 1 and r.total_s >= r.bound_s


def test_groups_that_train_nothing_are_not_charged_to_the_on_policy_bound() -> None:
    """Groups of one run get one reward each: nothing trains, so the bound charges no training
    (it did, and elastic and colocate finished below it: 167.5 s against 171.5 s)."""
    cfg = SimConfig(cells=2, capacity=4, prompts=2, group_size=1, steps=2)
    for mode in ("elastic", "colocate"):
        r = simulate(cfg, mode)
        assert r.step_bound_s is not None and r.total_s >= r.step_bound_s * (1 - 1e-9), mode


def test_the_old_bound_was_beaten_and_the_new_one_is_not() -> None:
    """Charging every step its publication and a stopped execution its whole duration made a
    bound that in-flight updates beat (with one execution 50× the median stopped, and with
    none stopped); the bound of served and trained work with one publication holds."""
    cfg = SimConfig(
        cells=3, capacity=2, pool_capacity=4, prompts=4, group_size=3, steps=4, duration_sigma=0.94,
        publish_s=120.0, max_staleness=3, lookahead=1.0, seed=242,
    )  # fmt: skip
    stopped_cfg = cfg.with_(max_staleness=1, timeout_s=1e9, publish_s=0.5, seed=7)
    for c, workload in ((cfg, None), (stopped_cfg, one_outlier(stopped_cfg, 50.0, range(1, 2)))):
        sim = Simulation(c, "elastic", workload)
        r = sim.run()
        by_step = sim.data.groups
        total = lambda times: sum(map(sum, times))  # noqa: E731
        old = sum(  # the old bound: full durations, a publication a step
            work_bound(total(g.durations for g in gs), total(g.micro_steps for g in gs), c) + c.publish_s
            for s, gs in by_step.items()
            if s <= c.steps
        )
        assert r.total_s < old and r.total_s >= r.bound_s, (r.total_s, old, r.bound_s, sim.sampler.stopped)
    assert sim.sampler.stopped  # the second regime stops its outliers


def test_colocate_holds_idle_slots_through_the_long_tail() -> None:
    """A sampling cell holding the burst's last executions is mostly idle, not busy."""
    elastic, colocate = (simulate(LONG_TAIL, m) for m in ("elastic", "colocate"))
    share = lambda r: sum(c.idle_slots for c in r.cells) / sum(c.sampling + c.idle_slots for c in r.cells)  # noqa: E731
    assert share(colocate) > 0.2 and share(elastic) < share(colocate)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4), st.integers(2, 8), st.floats(0.3, 1.5), st.integers(1, 3),
    st.sampled_from([0.25, 0.5, 1.0]), st.sampled_from([0, 2]), st.integers(0, 10**6),
)  # fmt: skip
def test_in_flight_updates_never_cut_an_execution_and_train_each_group_once_within_k(
    cells: int, capacity: int, sigma: float, k: int, ahead: float, checkpoint_every: int, seed: int
) -> None:
    cfg = SimConfig(
        cells=cells, capacity=capacity, prompts=4, group_size=3, steps=5, duration_sigma=sigma,
        max_staleness=k, lookahead=ahead, checkpoint_every=checkpoint_every, seed=seed,
    )  # fmt: skip
    sim = Simulation(cfg, "elastic")
    r = sim.run()
    assert len(r.step_ends) == cfg.steps
    s = sim.sampler
    assert set(s.served) == set(s.durations)  # every execution ended (the last step is a barrier)
    for run, served in s.served.items():
        if run not in s.stopped:  # an update never cuts one: it is served its whole duration
            assert served == pytest.approx(s.durations[run])
    groups = [(g["step"], g["task"]) for record in sim.records for g in record.stats["groups"]]
    assert sorted(groups) == sorted(set(groups)) and len(groups) == cfg.steps * cfg.prompts  # each once
    lags = [int(lag) for record in sim.records for lag in record.staleness_tokens]
    assert all(0 <= lag <= k for lag in lags)
    assert r.total_s >= r.bound_s * (1 - 1e-9)


def test_in_flight_closes_steps_before_their_longest_execution() -> None:
    """With a long tail, a step's quota is in long before its last execution ends: the in-flight
    run is faster than the barrier, and some groups land a version later."""
    barrier = Simulation(LONG_TAIL, "elastic")
    inflight = Simulation(LONG_TAIL.with_(max_staleness=2, lookahead=0.5), "elastic")
    a, b = barrier.run(), inflight.run()
    assert b.total_s < a.total_s
    assert max(int(lag) for record in inflight.records for lag in record.staleness_tokens) > 0


def test_a_replay_charges_no_execution_the_wait_for_a_slot_as_overhead() -> None:
    """Async with one of two cells sampling, 2 slots: of four executions dispatched at once, the
    engine served the last two first (calls reach it in whatever order their agents make them)
    and the first two waited 1.1 s. None of the four is known to have had a slot at once, so the
    least overhead any showed (0.1 s) stands in; an execution dispatched once the queue had
    drained is measured as it is (0.2 s), and the queued ones no longer count."""
    cells = CellsConfig(count=2, capacity=2)
    runs = [f"s0001-emulated-1-0-g{i}" for i in range(4)]
    late = "s0001-emulated-1-1-g0"
    served = [runs[2], runs[3], runs[0], runs[1]]
    step = ev.Step(
        step=1,
        version=1,
        seconds=2.0,
        sample_seconds=1.5,
        roles={"0": "training", "1": "sampling"},
        groups=[
            {"task": "emulated-1-0", "run_tokens": [10] * 4, "sequence_tokens": [10] * 4},
            {"task": "emulated-1-1", "run_tokens": [10], "sequence_tokens": [10]},
        ],
        apply_seconds=0.5,
        t=9.0,
    )
    burst: list[ev.Event] = [
        ev.SwitchRole(cell=0, role="training", seq=1, t=0.0),
        ev.RoleSwitched(cell=0, role="training", seq=1, seconds=0.1, t=0.1),
        *(ev.Dispatched(run=r, d=i + 1, p=0, f=0, t=1.0) for i, r in enumerate(runs)),
        # 10 tokens at 0.1 s each: 1.0 s served, then 0.1 s of overhead
        *(ev.Finished(run=r, d=4, p=4, f=i + 1, t=2.1 + 1.1 * (i // 2)) for i, r in enumerate(served)),
    ]
    assert uncontended_dispatches([*burst, step], cells) == {}
    assert measured_costs([*burst, step], cells, 0.1)["exec_overhead_s"] == pytest.approx(0.1)
    alone = [ev.Dispatched(run=late, d=5, p=4, f=4, t=4.0), ev.Finished(run=late, d=5, p=5, f=5, t=5.2)]
    assert set(uncontended_dispatches([*burst, *alone, step], cells)) == {late}
    assert measured_costs([*burst, *alone, step], cells, 0.1)["exec_overhead_s"] == pytest.approx(0.2)
    # Both cells sampling: four slots, none of the four waited.
    assert set(uncontended_dispatches(burst[2:], cells)) == set(runs)


def test_the_simulated_paper_run_is_the_shape_the_memory_plan_fits() -> None:
    """``paper-2.4t`` stands for the 2.4T MoE on H200 cells the memory plan lays out: the plan
    fits, and a cell's engine replicas hold a full context for each execution it serves."""
    from conftest import REPO

    from gyre_hpc.models.catalog import model_shape
    from gyre_hpc.plan.memory import plan
    from gyre_hpc.recipe import load_recipe
    from gyre_hpc.sim.config import CONFIGS, PAPER_2_4T

    sim = CONFIGS["paper-2.4t"]
    assert sim.shape == PAPER_2_4T
    r = load_recipe(REPO / "recipes" / "qwen3-8b-8cells.toml", list(sim.shape))
    p = plan(model_shape(r.run.model), r.cells, r.engine, r.trainer, r.agent, r.slurm.nodes_per_cell)
    assert p is not None and p.refusal() is None
    assert "2491.29B parameters (56.04B active a token)" in p.model
    replicas = r.cells.ranks_per_cell // r.engine.tp_size
    assert sim.capacity <= replicas * (p.kv_tokens // p.context_tokens)
