"""``bench modes``: the recipe run for real in each mode, one after another, step times side by
side; with emulated GPUs each run is also replayed in the simulator.

```
 recipe ─▶ plan: each mode of bench.modes, async once per split (every split when empty), ours
       ─▶ one `gyre-hpc run` per mode (same workload, cells and seed; no eval, no checkpoints)
       ─▶ emulated? replay each run in the simulator, with the costs one elastic run measured
       ─▶ table: step time real (and simulated), against the bounds; speed-ups; plots
```

Step 1 is the warm-up and not counted. It knows nothing of what a run does inside: it reads each
run's events and recipe from its directory.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import mean

from gyre_hpc.bench.replay import measured_costs, observed, replay
from gyre_hpc.bench.report import Report, Table
from gyre_hpc.bench.sim import best_async, speedups
from gyre_hpc.errors import GyreError
from gyre_hpc.observability import events as ev
from gyre_hpc.recipe.schema import Recipe
from gyre_hpc.rundir import RunDir
from gyre_hpc.sim.config import INFLIGHT_KS, OURS, async_name, inflight_name
from gyre_hpc.sim.plots import plot_all
from gyre_hpc.sim.simulate import SimResult, simulate


def plan(r: Recipe, ours: bool) -> dict[str, list[str]]:
    """Each run's name and the overrides that make its mode."""
    n = r.cells.count
    runs: dict[str, list[str]] = {}
    for mode in r.bench.modes:
        if mode != "async":
            runs[mode] = [f"scheduler.mode={mode}"]
            continue
        top = n if r.cells.rollout_pool else n - 1  # the recipe checked bench.async_splits
        for k in r.bench.async_splits or range(1, top + 1):
            runs[async_name(k, n)] = ["scheduler.mode=async", f"scheduler.async_train_cells={k}"]
    if ours:
        runs[OURS] = ["scheduler.mode=elastic", "scheduler.carry_tail=true"]
        for k in INFLIGHT_KS:
            runs[inflight_name(k)] = ["scheduler.mode=elastic", f"scheduler.max_staleness={k}"]
    return runs


def compare(
    recipe: Path,
    r: Recipe,
    steps: int,
    sets: list[str],
    out: Path,
    ours: bool,
    note: Callable[[str], None] = lambda line: None,
) -> Report:
    """Every planned run of ``recipe`` (``r``: it with ``sets``), one after another (``note``
    says which starts), tabulated and plotted into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    report: Report = []
    runs = {}
    for name, variant in plan(r, ours).items():
        note(f"running {name} …")
        runs[name] = run_mode(recipe, name, [*variant, *sets], steps, out / "runs")
    if not all(summarize(rd)["steps"] for rd in runs.values()):
        raise GyreError("bench modes: give --steps 2 or more (step 1 is the warm-up)")
    simulated = replay_all(runs) if all(is_emulated(rd) for rd in runs.values()) else {}
    report.append(step_table(f"{recipe}, steps 2–{steps} (same seed)", runs, simulated))
    step_s = {name: summarize(rd)["step_s"] for name, rd in runs.items()}
    sim = {name: mean(s.step_times[1:]) for name, s in simulated.items()}
    for label, times in (("real", step_s), ("simulated", sim)):
        report += [f"{label}: {line}" for line in speedups(times)]
    best = best_async(step_s)
    keep = lambda results: {k: v for k, v in results.items() if not k.startswith("async") or k == best}  # noqa: E731
    real = {name: observed(rd.path) for name, rd in runs.items()}
    plots = plot_all(keep(real), out / "real", f"{recipe.stem} (real)", "s")
    if simulated:
        plots += plot_all(keep(simulated), out / "simulated", f"{recipe.stem} (simulated)", "s")
    return report + [f"plot: {p}" for p in plots]


def step_table(title: str, runs: dict[str, RunDir], simulated: dict[str, SimResult]) -> Table:
    """The step-time table: real, and simulated where replayed, against the bounds of each run's
    own recorded work with the calibrated costs (``sim.bound``)."""
    columns = ["mode", "step s", "sampling s", "training began before burst end (s)", "reward"]
    if simulated:
        columns += [
            "simulated step s",
            "simulated / real",
            "bound s",
            "real / bound",
            "real / on-policy bound",
        ]
    table = Table(title=title, columns=tuple(columns))
    real = {name: summarize(rd) for name, rd in runs.items()}
    best = best_async({name: r["step_s"] for name, r in real.items()})
    for name, r in real.items():
        row = [
            name + (" (best async)" if name == best else ""),
            f"{r['step_s']:.2f}",
            f"{r['sample_s']:.2f}",
            f"{r['early_s']:.2f}",
            f"{r['reward']:.3f}",
        ]
        if simulated:
            s = simulated[name]
            sim, bound = mean(s.step_times[1:]), mean(s.work_bounds[1:])
            on_policy = mean(s.step_bounds[1:]) if s.in_series else None
            row += [
                f"{sim:.2f}",
                f"{sim / r['step_s']:.3f}",
                f"{bound:.2f}",
                f"{r['step_s'] / bound:.3f}",
                "—" if on_policy is None else f"{r['step_s'] / on_policy:.3f}",
            ]
        table.rows.append(tuple(row))
    return table


def run_mode(recipe: Path, name: str, overrides: list[str], steps: int, root: Path) -> RunDir:
    """One real run of ``recipe`` under ``overrides``, in a directory of its own under ``root``."""
    where = root / name.replace("/", "of").replace(" ", "-")
    overrides = [
        f"run.steps={steps}",
        "tasks.eval_every=0",
        "trainer.checkpoint_every=0",
        f"run.runs_dir={where}",
        *overrides,
    ]
    args = [sys.executable, "-m", "gyre_hpc", "run", str(recipe)]
    for o in overrides:
        args += ["--set", o]
    before = set(where.iterdir()) if where.exists() else set()
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode:
        raise GyreError(f"bench modes: the {name} run failed: {proc.stderr.strip().splitlines()[-1]}")
    return RunDir(max(set(where.iterdir()) - before))


def is_emulated(run_dir: RunDir) -> bool:
    r = run_dir.read_recipe()
    return r.engine.backend == "emulated" and r.trainer.backend == "emulated"


def replay_all(runs: dict[str, RunDir]) -> dict[str, SimResult]:
    """Each run's recorded workload, simulated with the costs measured in one elastic run (the
    one with switch events), so a single calibration predicts every mode."""
    calibration = runs.get("elastic") or next(iter(runs.values()))
    recipe = calibration.read_recipe()
    costs = measured_costs(calibration.read_events(), recipe.cells, recipe.engine.emulated_decode_s)
    out = {}
    for name, run_dir in runs.items():
        cfg, workload = replay(run_dir.path, costs)
        out[name] = simulate(cfg, run_dir.read_recipe().scheduler.mode, workload)
    return out


def summarize(run_dir: RunDir) -> dict[str, float]:
    """Its steps after the warm-up: how many, and their mean time, sampling, reward, overlap."""
    steps = [e for e in run_dir.read_events() if isinstance(e, ev.Step)][1:]
    if not steps:
        return {"steps": 0}
    return {
        "steps": len(steps),
        "step_s": mean(e.seconds for e in steps),
        "sample_s": mean(e.sample_seconds for e in steps),
        "reward": mean(e.reward_mean for e in steps),
        "early_s": mean(e.train_before_burst_end_s or 0.0 for e in steps),
    }
