"""``gyre-hpc bench sim`` and ``gyre-hpc bench modes``: the scheduling modes side by side, in the
discrete-event simulator (``bench.sim``) or as real runs of a recipe (``bench.modes``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gyre_hpc.bench import modes as bench_modes
from gyre_hpc.bench import sim as bench_sim
from gyre_hpc.cli.output import CsvOption, JsonOption, Results, chosen
from gyre_hpc.errors import GyreError
from gyre_hpc.recipe.load import load_recipe, with_sets
from gyre_hpc.sim.config import CONFIGS, OURS

app = typer.Typer(help="Compare scheduling modes.", no_args_is_help=True)


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

    The simulator runs the runtime's own step kinds (`gyre_hpc.scheduler.steps`).

    Example: `gyre-hpc bench sim --config paper-2.4t --ablations`
    """
    results = Results(chosen(as_json, as_csv))
    if config not in CONFIGS:
        raise GyreError(f"--config {config}: unknown; valid: {', '.join(CONFIGS)}")
    cfg = with_sets(CONFIGS[config], set_ or [], "simulator")
    results.report(bench_sim.compare(config, cfg, out, ablations))


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
    results = Results(chosen(as_json, as_csv))
    sets = [*(set_ or []), *([f"cells.count={cells}"] if cells else [])]
    r = load_recipe(recipe, sets)
    results.report(bench_modes.compare(recipe, r, steps, sets, out, ours, note=results.note))
