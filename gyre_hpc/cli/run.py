"""``gyre-hpc run RECIPE``: the whole system on this machine, under mpirun, with live progress."""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from gyre_hpc.cli.recipe import RecipeArg, SetOption, load
from gyre_hpc.launch.local import LocalRun
from gyre_hpc.rundir import RunDir
from gyre_hpc.runtime.world import Layout

EXIT = {"completed": 0, "failed": 1, "interrupted": 130}


def run(recipe: RecipeArg, set_: SetOption = None) -> None:
    """Run a recipe locally: 1 controller + the recipe's cells as MPI ranks on this machine.

    Writes `runs/<name>-<time>/` (resolved recipe, events.jsonl, logs) and shows progress.
    Exit code 0 when the run completes, 1 when a rank fails (its message is printed),
    130 when interrupted (Ctrl-C or SIGTERM stop every rank within seconds).

    Example: `gyre-hpc run recipes/smoke.toml --set cells.count=3 --set scheduler.mode=async`
    """
    r = load(recipe, set_)
    layout = Layout.from_config(r.cells)
    run_dir = RunDir.create(r.run.runs_dir, r.run.name)
    run_dir.write_recipe(r)
    console = Console(stderr=True, soft_wrap=True)
    console.print(f"[bold]gyre-hpc run[/] {layout.describe()} → [cyan]{run_dir.path}[/]")
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        cells = progress.add_task("cells up", total=layout.units)
        steps = progress.add_task("steps", total=r.run.steps)

        def show(events: list[dict[str, Any]]) -> None:
            for e in events:
                if e["event"] == "hello":
                    progress.advance(cells)
                elif e["event"] == "step":
                    progress.update(steps, completed=e["step"])

        end = LocalRun(run_dir, layout).launch(show)
    style = {"completed": "green", "failed": "bold red"}.get(end["status"], "yellow")
    reason = f": {end['reason']}" if end["reason"] else ""
    console.print(f"[{style}]run {end['status']}[/]{reason}\nrun directory: {run_dir.path}")
    raise typer.Exit(EXIT.get(end["status"], 1))
