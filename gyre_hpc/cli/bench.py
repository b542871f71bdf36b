"""``gyre-hpc bench sim`` and ``gyre-hpc bench modes``: the scheduling modes side by side, in the
discrete-event simulator or as real runs of a recipe.

Async is a family of baselines, one per fixed split; both commands run every split (or the
recipe's ``bench.async_splits``) and compare elastic against the best one, never a chosen one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from statistics import mean
from typing import Annotated

import typer
from rich.table import Table

from gyre_hpc.bench.replay import measured_costs, observed, replay
from gyre_hpc.cli.output import CsvOption, JsonOption, Results, chosen
from gyre_hpc.errors import GyreError
from gyre_hpc.observability import events as ev
from gyre_hpc.recipe.load import load_recipe, with_sets
from gyre_hpc.rundir import RunDir
from gyre_hpc.sim.config import (
    CONFIGS,
    INFLIGHT_KS,
    OURS,
    PAPER_ABLATIONS,
    SimConfig,
    ablations,
    async_name,
    inflight_name,
    variants,
)
from gyre_hpc.sim.plots import plot_all
from gyre_hpc.sim.simulate import SimResult, simulate

app = typer.Typer(help="Compare scheduling modes.", no_args_is_help=True)


def best_async(times: dict[str, float]) -> str | None:
    """The async variant with the shortest time (None when there is none)."""
    splits = [name for name in times if name.startswith("async")]
    return min(splits, key=times.__getitem__) if splits else None


def speedups(times: dict[str, float]) -> list[str]:
    """Elastic against the best async split and colocate, and ours against the paper's rule."""
    lines = []
    e, a = times.get("elastic"), best_async(times)
    if e and a:
        lines.append(f"elastic {times[a] / e:.2f}× vs the best async ({a}, of every split run)")
    if e and "colocate" in times:
        lines.append(f"elastic {times['colocate'] / e:.2f}× vs colocate")
    if e and OURS in times:
        lines.append(
            f"ours ({OURS}, scheduler.carry_tail) {e / times[OURS]:.3f}× vs the paper's elastic rule"
        )
    for k in INFLIGHT_KS:
        if e and (name := inflight_name(k)) in times:
            lines.append(f"ours ({name}, scheduler.max_staleness) {e / times[name]:.3f}× vs the paper's rule")
    return lines


@app.command()
def sim(
    config: Annotated[str, typer.Option(help=f"Named configuration: {', '.join(CONFIGS)}.")] = "smoke",
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a field: key=value.")] = None,
    out: Annotated[Path, typer.Option(help="Where the plots go.")] = Path("bench-sim"),
    ablations: Annotated[bool, typer.Option(help="Also run the paper's ablation of cell size.")] = False,
    as_json: JsonOption = False,
    as_csv: CsvOption = False,
) -> None:
    """Simulate elastic, colocate and every async split on one workload — and elastic with our
    carry_tail — print total times and ratios against the best async split, plot.

    The simulator drives the runtime's own scheduling policy (`gyre_hpc.scheduler.policy`).

    Example: `gyre-hpc bench sim --config paper-2.4t --ablations`
    """
    results_out = Results(chosen(as_json, as_csv))
    if config not in CONFIGS:
        raise GyreError(f"--config {config}: unknown; valid: {', '.join(CONFIGS)}")
    cfg = with_sets(CONFIGS[config], set_ or [], "simulator")
    runs = variants(cfg)
    results = {name: simulate(c, mode) for name, (mode, c) in runs.items()}
    times = {name: r.total_s for name, r in results.items()}
    best = best_async(times)
    shape = f"{cfg.cells} cells × {cfg.capacity}, {cfg.prompts}×{cfg.group_size} executions"
    table = Table(title=f"{config}: {shape}, {cfg.steps} steps")
    columns = ("mode", "total h", "mean step h", "total / bound", "total / on-policy bound", "sampling",
               "idle slots", "training", "idle", "switching", "switches")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for name, r in results.items():
        share = r.time_split()
        table.add_row(
            name + (" (best async)" if name == best else ""),
            f"{r.total_s / 3600:.2f}",
            f"{r.total_s / 3600 / len(r.step_ends):.3f}",
            f"{r.total_s / r.bound_s:.3f}",
            "—" if r.step_bound_s is None else f"{r.total_s / r.step_bound_s:.3f}",
            *(f"{share[k]:.0%}" for k in ("sampling", "idle slots", "training", "idle", "switching")),
            str(r.switches),
        )
    results_out.table(table)
    elastic = results.get("elastic") or next(iter(results.values()))
    results_out.note(
        f"bound {elastic.bound_s / 3600:.2f} h ({elastic.bound_s / 3600 / cfg.steps:.3f} h a step, elastic's "
        "work): the sampling each run was served and the training it did, spread over every slot and "
        "cell, and the last publication; each mode is over its own served work. On-policy bound "
        f"{(elastic.step_bound_s or 0.0) / 3600:.2f} h: steps in series, each its work or its longest "
        "execution and the training that must follow it, and its publication (colocate and elastic only)"
    )
    for line in speedups(times):
        results_out.note(line)
    if ablations:
        results_out.table(_ablation_table(cfg, config))
    shown = {n: r for n, r in results.items() if not n.startswith("async") or n == best}
    for p in plot_all(shown, out, config):
        results_out.note(f"plot: {p}")


def _ablation_table(cfg: SimConfig, config: str) -> Table:
    table = Table(title=f"{config}: ablations")
    for col in ("ablation", "baseline h", "variant h", "baseline / variant", "paper"):
        table.add_column(col, justify="right")
    for name, ((m0, c0), (m1, c1)) in ablations(cfg).items():
        t0, t1 = simulate(c0, m0).total_s, simulate(c1, m1).total_s
        table.add_row(name, f"{t0 / 3600:.1f}", f"{t1 / 3600:.1f}", f"{t0 / t1:.3f}", PAPER_ABLATIONS[name])
    return table


@app.command()
def modes(
    recipe: Annotated[Path, typer.Argument(help="Recipe TOML file.", show_default=False)],
    steps: Annotated[int, typer.Option(help="Steps per mode (step 1, the warm-up, is not counted).")] = 4,
    cells: Annotated[int, typer.Option(help="Cells, the same for every mode (0: the recipe's).")] = 0,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Recipe override, section.key=value.")
    ] = None,
    out: Annotated[Path, typer.Option(help="Where the run directories and plots go.")] = Path("bench-modes"),
    ours: Annotated[
        bool,
        typer.Option(help=f"Also run ours: {OURS} (scheduler.carry_tail), in-flight (max_staleness 1, 2)."),
    ] = False,
    as_json: JsonOption = False,
    as_csv: CsvOption = False,
) -> None:
    """Run the recipe in each mode of `bench.modes` — async once per split of
    `bench.async_splits` (every split when empty) — one after another, and compare step times:
    elastic against the best async split and against colocate.

    Same workload, cells and seed for every run. With emulated GPUs (`engine.backend` and
    `trainer.backend` = "emulated", e.g. recipes/emulated.toml) each run is also replayed in the
    simulator, with costs measured in the elastic run, and the two step times are set side by
    side. With real compute on a laptop-class machine every cell shares the same few cores, so
    overlapping training with sampling gains nothing there.

    Example: `gyre-hpc bench modes recipes/emulated.toml --steps 6`
    """
    report = Results(chosen(as_json, as_csv))
    out.mkdir(parents=True, exist_ok=True)
    r = load_recipe(recipe, [*(set_ or []), *([f"cells.count={cells}"] if cells else [])])
    n = r.cells.count
    plan: dict[str, list[str]] = {}
    for mode in r.bench.modes:
        if mode != "async":
            plan[mode] = [f"scheduler.mode={mode}"]
            continue
        top = n if r.cells.rollout_pool else n - 1  # the recipe checked bench.async_splits
        for k in r.bench.async_splits or range(1, top + 1):
            plan[async_name(k, n)] = ["scheduler.mode=async", f"scheduler.async_train_cells={k}"]
    if ours:
        plan[OURS] = ["scheduler.mode=elastic", "scheduler.carry_tail=true"]
        for k in INFLIGHT_KS:
            plan[inflight_name(k)] = ["scheduler.mode=elastic", f"scheduler.max_staleness={k}"]
    runs = {}
    for name, variant in plan.items():
        report.note(f"running {name} …")
        runs[name] = _run_mode(recipe, name, variant, steps, cells, set_ or [], out / "runs")
    if not all(_summarize(rd)["steps"] for rd in runs.values()):
        raise GyreError("bench modes: give --steps 2 or more (step 1 is the warm-up)")
    simulated = _replay_all(runs) if all(_is_emulated(rd) for rd in runs.values()) else {}
    _report(report, f"{recipe}, steps 2–{steps} (same seed)", runs, simulated)
    real = {name: observed(rd.path) for name, rd in runs.items()}
    best = best_async({name: _summarize(rd)["step_s"] for name, rd in runs.items()})
    keep = lambda results: {k: v for k, v in results.items() if not k.startswith("async") or k == best}  # noqa: E731
    plots = plot_all(keep(real), out / "real", f"{recipe.stem} (real)", "s")
    if simulated:
        plots += plot_all(keep(simulated), out / "simulated", f"{recipe.stem} (simulated)", "s")
    for p in plots:
        report.note(f"plot: {p}")


def _report(report: Results, title: str, runs: dict[str, RunDir], simulated: dict[str, SimResult]) -> None:
    """The step-time table (real, and simulated where replayed) and the speed-ups."""
    table = Table(title=title)
    for col in ("mode", "step s", "sampling s", "training began before burst end (s)", "reward"):
        table.add_column(col, justify="right")
    if simulated:
        cols = ("simulated step s", "simulated / real", "bound s", "real / bound", "real / on-policy bound")
        for col in cols:
            table.add_column(col, justify="right")
    real = {name: _summarize(rd) for name, rd in runs.items()}
    sim = {name: mean(r.step_times[1:]) for name, r in simulated.items()}
    # The bounds of each run's own recorded work, with the calibrated costs (``sim.bound``): its
    # served and trained work (a step's publication may overlap the next step's sampling), and
    # the on-policy bound where steps run in series.
    bound = {name: mean(r.work_bounds[1:]) for name, r in simulated.items()}
    on_policy = {name: mean(r.step_bounds[1:]) if r.in_series else None for name, r in simulated.items()}
    step_s = {name: r["step_s"] for name, r in real.items()}
    best = best_async(step_s)
    for name, r in real.items():
        row = [
            name + (" (best async)" if name == best else ""),
            f"{r['step_s']:.2f}",
            f"{r['sample_s']:.2f}",
            f"{r['early_s']:.2f}",
            f"{r['reward']:.3f}",
        ]
        if simulated:
            b, p = bound[name], on_policy[name]
            row += [
                f"{sim[name]:.2f}",
                f"{sim[name] / r['step_s']:.3f}",
                f"{b:.2f}",
                f"{r['step_s'] / b:.3f}",
                "—" if p is None else f"{r['step_s'] / p:.3f}",
            ]
        table.add_row(*row)
    report.table(table)
    for label, times in (("real", step_s), ("simulated", sim)):
        for line in speedups(times):
            report.note(f"{label}: {line}")


def _slug(name: str) -> str:
    return name.replace("/", "of").replace(" ", "-")


def _run_mode(
    recipe: Path, name: str, variant: list[str], steps: int, cells: int, sets: list[str], root: Path
) -> RunDir:
    where = root / _slug(name)
    overrides = [
        *variant,
        f"run.steps={steps}",
        *([f"cells.count={cells}"] if cells else []),
        "tasks.eval_every=0",
        "trainer.checkpoint_every=0",
        f"run.runs_dir={where}",
        *sets,
    ]
    args = [sys.executable, "-m", "gyre_hpc", "run", str(recipe)]
    for o in overrides:
        args += ["--set", o]
    before = set(where.iterdir()) if where.exists() else set()
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode:
        raise GyreError(f"bench modes: the {name} run failed: {proc.stderr.strip().splitlines()[-1]}")
    return RunDir(max(set(where.iterdir()) - before))


def _is_emulated(run_dir: RunDir) -> bool:
    r = run_dir.read_recipe()
    return r.engine.backend == "emulated" and r.trainer.backend == "emulated"


def _replay_all(runs: dict[str, RunDir]) -> dict[str, SimResult]:
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


def _summarize(run_dir: RunDir) -> dict[str, float]:
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
