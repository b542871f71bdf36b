"""``gyre-hpc bench sim``: the scheduling modes side by side in the discrete-event simulator."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gyre_hpc.errors import GyreError
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
