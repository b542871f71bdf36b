"""The simulator drives the runtime's policy; its runs keep the same invariants as the runtime."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import gyre

from gyre_hpc.sim.config import CONFIGS, SimConfig
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
