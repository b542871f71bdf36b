"""``gyre-hpc recipe check|show|keys``, and the recipe arguments every command shares."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.syntax import Syntax

from gyre_hpc.errors import RecipeError
from gyre_hpc.launch.check import check_launch
from gyre_hpc.recipe import Recipe, load_recipe, to_toml
from gyre_hpc.recipe.load import schema_lines

RecipeArg = Annotated[Path, typer.Argument(help="Recipe TOML file.", show_default=False)]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", metavar="SECTION.KEY=VALUE", help="Override a recipe key (repeatable)."),
]

app = typer.Typer(help="Check and inspect recipes.", no_args_is_help=True)


def load(path: Path, sets: list[str] | None) -> Recipe:
    return load_recipe(path, sets or [])


@app.command()
def check(recipe: RecipeArg, set_: SetOption = None) -> None:
    """Validate a recipe and say whether `run` and `submit` can run it; one line, exit code 2
    on the first error or when it is not runnable.

    With `cells.gpu_memory_gib` set, it prints the memory plan of a cell's worst GPU while it
    samples and while it trains, and refuses a recipe that does not fit.

    Example: `gyre-hpc recipe check recipes/smoke.toml --set cells.count=4`
    """
    r = load(recipe, set_)
    try:
        launch = check_launch(r)
    except RecipeError as err:
        raise RecipeError(f"{recipe}: valid, but not runnable: {err}") from None
    cells = r.cells
    typer.echo(
        f"{recipe}: ok — {r.scheduler.mode}, {cells.count} cells × {cells.ranks_per_cell} ranks, "
        f"engine {r.engine.backend}, trainer {r.trainer.backend}, model {r.run.model}"
    )
    engines = launch.engines
    typer.echo(f"engine replicas a cell: {engines.replicas}, tensor-parallel {r.engine.tp_size}")
    if cells.ranks_per_cell > 1:
        typer.echo("\n".join(f"  {line}" for line in engines.describe().splitlines()))
    if launch.memory is not None:
        typer.echo("\n".join(launch.memory.lines()))
    elif r.cells.gpu_memory_gib:
        typer.echo(f"memory plan: none (the shape of {r.run.model} is not known here)")
    for line in launch.warnings:
        typer.echo(line)


@app.command()
def show(
    recipe: RecipeArg,
    set_: SetOption = None,
    docs: Annotated[bool, typer.Option(help="Print each key's documentation.")] = True,
) -> None:
    """Print the resolved recipe: every key, defaults filled in, overrides applied."""
    text = to_toml(load(recipe, set_), docs=docs)
    Console().print(Syntax(text, "toml", theme="ansi_dark", background_color="default"))


@app.command()
def keys() -> None:
    """List every recipe key with its type and default."""
    typer.echo("\n".join(schema_lines()))
