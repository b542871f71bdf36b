"""The simulator drives the runtime's policy; its runs keep the same invariants as the runtime."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import gyre

from gyre_hpc.sim.config import CONFIGS, SimConfig, ablations
from gyre_hpc.sim.simulate import Simulation, simulate

LONG_TAIL = SimConfig(cells=4, capacity=8, prompts=8, group_size=4, steps=5, duration_sigma=1.0)


@pytest.mark.parametrize("mode", ["elastic", "async", "colocate"])
def test_every_step_trains_all_its_micro_steps(mode: str) -> None:
    sim = Simulation(LONG_TAIL, mode)
    result = sim.run()
    assert len(result.step_ends) == LONG_TAIL.steps
    assert result.step_ends == sorted(result.step_ends)
    trained = [w for s, w in sim.step_work.items() if s <= LONG_TAIL.steps]
    assert trained == [0] * LONG_TAIL.steps  # nothing left untrained, nothing trained twice
    for cell in result.cells:  # cell time adds up to the run's length
        assert abs(cell.sampling + cell.training + cell.idle + cell.switching - result.total_s) < 1e-6


def test_modes_behave_as_their_rules_say() -> None:
    elastic, asyn, colocate = (simulate(LONG_TAIL, m) for m in ("elastic", "async", "colocate"))
    assert asyn.switches == 0  # a fixed split
    assert colocate.switches % LONG_TAIL.cells == 0  # all cells switch together
    assert elastic.total_s < colocate.total_s  # training overlaps the burst's long tail


def test_paper_regime_ratios_stay_near_the_paper() -> None:
    cfg = CONFIGS["paper-2.4t"].with_(steps=12)
    r = {m: simulate(cfg, m).total_s for m in ("elastic", "async", "colocate")}
    assert 1.78 * 0.85 <= r["async"] / r["elastic"] <= 1.78 * 1.15
    assert 1.21 * 0.85 <= r["colocate"] / r["elastic"] <= 1.21 * 1.15


def test_bench_sim_prints_ratios_and_plots(tmp_path: Path) -> None:
    proc = gyre("bench", "sim", "--config", "smoke", "--set", "steps=3", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "elastic speed-up:" in proc.stdout
    assert {p.name for p in tmp_path.iterdir()} >= {"step_times.png", "gantt_elastic.png", "time_split.png"}
    bad = gyre("bench", "sim", "--set", "cels=3")
    assert bad.returncode == 2 and "unknown simulator key; valid: cells" in bad.stderr


def test_carry_tail_beats_the_paper_rule_in_both_paper_regimes() -> None:
    for name in ("paper-2.4t", "paper-122b"):
        cfg = CONFIGS[name].with_(steps=16)
        paper = simulate(cfg, "elastic")
        ours = simulate(cfg.with_(carry_tail=True), "elastic")
        assert ours.total_s < paper.total_s * 0.99, name  # the last step still trains its whole tail


def test_carried_work_is_trained_once_and_never_carried_twice() -> None:
    cfg = LONG_TAIL.with_(carry_tail=True, steps=8)
    sim = Simulation(cfg, "elastic")
    sim.run()
    assert sim.stopping  # some step was applied at its burst's end
    assert cfg.steps not in sim.stopping and not sim.carried  # the last step trains its whole tail
    assert all(w == 0 for w in sim.step_work.values())
    for step in sim.stopping:  # a step that carried its tail had trained all it was handed
        assert sim.started.get(step, 0) >= sim.carried_in.get(step, 0)


def test_ablations_go_the_paper_s_way() -> None:
    cfg = CONFIGS["paper-2.4t"].with_(steps=12)
    ratio = {}
    for name, ((m0, c0), (m1, c1)) in ablations(cfg).items():
        ratio[name] = simulate(c0, m0).total_s / simulate(c1, m1).total_s
    assert ratio["streaming alone on async"] >= 1.0
    assert ratio["elastic vs colocate with streaming"] > 1.1
    assert 0.95 <= ratio["half as many cells, twice as large"] <= 1.0


def test_bench_sim_reports_ours_and_the_ablations(tmp_path: Path) -> None:
    proc = gyre(
        "bench", "sim", "--config", "smoke", "--set", "steps=3", "--ablations", "--out", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    assert "vs the paper's elastic rule" in proc.stdout and "ablations" in proc.stdout
    bad = gyre("bench", "sim", "--set", "streaming=maybe")
    assert bad.returncode == 2 and "valid: elastic, all, none" in bad.stderr
