"""``gyre-hpc bench sim`` and ``gyre-hpc bench modes``: the scheduling modes side by side, in the
discrete-event simulator or as real runs of a recipe."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gyre_hpc.errors import GyreError
from gyre_hpc.observability.events import read_events
from gyre_hpc.sim.config import CONFIGS, MODES, SimConfig
from gyre_hpc.sim.plots import plot_all
from gyre_hpc.sim.simulate import simulate

app = typer.Typer(help="Compare scheduling modes.", no_args_is_help=True)


def parse_sets(base: SimConfig, sets: list[str]) -> SimConfig:
    fields = {f.name: f for f in dataclasses.fields(SimConfig)}
    changes = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise GyreError(f"--set {item}: unknown simulator key; valid: {', '.join(fields)}")
        kind = type(getattr(base, key))
        try:
            changes[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
        except ValueError:
            raise GyreError(f"--set {item}: {key} must be a {kind.__name__}") from None
    return base.with_(**changes)


@app.command()
def sim(
    config: Annotated[str, typer.Option(help=f"Named configuration: {', '.join(CONFIGS)}.")] = "smoke",
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a field: key=value.")] = None,
    out: Annotated[Path, typer.Option(help="Where the plots go.")] = Path("bench-sim"),
) -> None:
    """Simulate elastic, async and colocate on one workload; print step times and ratios, plot.

    The simulator drives the runtime's own scheduling policy (`gyre_hpc.scheduler.policy`).

    Example: `gyre-hpc bench sim --config paper-2.4t --set streaming=false`
    """
    if config not in CONFIGS:
        raise GyreError(f"--config {config}: unknown; valid: {', '.join(CONFIGS)}")
    cfg = parse_sets(CONFIGS[config], set_ or [])
    results = {mode: simulate(cfg, mode) for mode in MODES}
    shape = f"{cfg.cells} cells × {cfg.capacity}, {cfg.prompts}×{cfg.group_size} executions"
    table = Table(title=f"{config}: {shape}, {cfg.steps} steps")
    for col in ("mode", "total h", "mean step h", "sampling", "training", "idle", "switching", "switches"):
        table.add_column(col, justify="right")
    for mode, r in results.items():
        cell_s = r.total_s * len(r.cells)
        share = {
            k: sum(getattr(c, k) for c in r.cells) / cell_s
            for k in ("sampling", "training", "idle", "switching")
        }
        table.add_row(
            mode,
            f"{r.total_s / 3600:.2f}",
            f"{r.total_s / 3600 / len(r.step_ends):.3f}",
            *(f"{share[k]:.0%}" for k in ("sampling", "training", "idle", "switching")),
            str(r.switches),
        )
    console = Console()
    console.print(table)
    e = results["elastic"].total_s
    console.print(
        f"elastic speed-up: {results['async'].total_s / e:.2f}× vs async, "
        f"{results['colocate'].total_s / e:.2f}× vs colocate"
    )
    for p in plot_all(results, out, config):
        console.print(f"plot: {p}")


@app.command()
def modes(
    recipe: Annotated[Path, typer.Argument(help="Recipe TOML file.", show_default=False)],
    steps: Annotated[int, typer.Option(help="Steps per mode (step 1, the warm-up, is not counted).")] = 4,
    cells: Annotated[int, typer.Option(help="Cells, the same for every mode.")] = 3,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Recipe override, section.key=value.")
    ] = None,
) -> None:
    """Run the recipe in elastic, async and colocate mode, one after another, and compare step times.

    Same workload, cells and seed for every mode. On a laptop-class machine every cell shares the
    same few cores, so overlapping training with sampling gains nothing there: the simulator
    (`gyre-hpc bench sim`) is where separate devices are modelled.

    Example: `gyre-hpc bench modes recipes/smoke.toml --steps 4 --cells 3`
    """
    console = Console()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            console.print(f"running {mode} …")
            results[mode] = _summarize(_run_mode(recipe, mode, steps, cells, set_ or [], Path(tmp)))
    table = Table(title=f"{recipe}, {cells} cells, steps 2–{steps} (same seed)")
    for col in ("mode", "step s", "sampling s", "training began before burst end (s)", "reward"):
        table.add_column(col, justify="right")
    for mode, r in results.items():
        table.add_row(
            mode, f"{r['step_s']:.2f}", f"{r['sample_s']:.2f}", f"{r['early_s']:.2f}", f"{r['reward']:.3f}"
        )
    console.print(table)
    e = results["elastic"]["step_s"]
    console.print(
        f"step-time speed-up of elastic: {results['async']['step_s'] / e:.2f}× vs async, "
        f"{results['colocate']['step_s'] / e:.2f}× vs colocate"
    )


def _run_mode(recipe: Path, mode: str, steps: int, cells: int, sets: list[str], root: Path) -> Path:
    overrides = [
        f"scheduler.mode={mode}",
        f"run.steps={steps}",
        f"cells.count={cells}",
        "tasks.eval_every=0",
        "trainer.checkpoint_every=0",
        f"run.runs_dir={root / mode}",
        *sets,
    ]
    args = [sys.executable, "-m", "gyre_hpc", "run", str(recipe)]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode:
        raise GyreError(f"bench modes: the {mode} run failed: {proc.stderr.strip().splitlines()[-1]}")
    return next((root / mode).iterdir())


def _summarize(run_dir: Path) -> dict[str, float]:
    steps = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "step"][1:]
    if not steps:
        raise GyreError("bench modes: give --steps 2 or more (step 1 is the warm-up)")
    return {
        "step_s": mean(e["seconds"] for e in steps),
        "sample_s": mean(e["sample_seconds"] for e in steps),
        "reward": mean(e["reward_mean"] for e in steps),
        "early_s": mean(e.get("train_before_burst_end_s") or 0.0 for e in steps),
    }
