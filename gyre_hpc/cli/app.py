"""The ``gyre-hpc`` command: every command group composed in one typer app.

``main`` turns a user's mistake (``GyreError``) into one line and an exit code, never a
traceback; set ``GYRE_DEBUG=1`` to see the traceback anyway.
"""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console
from rich.markup import escape

from gyre_hpc import __version__
from gyre_hpc.cli import bench, model, proxy, recipe, run, sandbox, slurm, status, tasks, traj
from gyre_hpc.cli import eval as eval_cli
from gyre_hpc.errors import GyreError
from gyre_hpc.launch.leave import leave

app = typer.Typer(
    name="gyre-hpc",
    help="Elastic online RL for long-horizon LLM agents, on Slurm or on this machine.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",
)
app.command()(run.run)
app.command()(slurm.submit)
app.command()(status.status)
app.command()(slurm.cancel)
app.command(name="eval")(eval_cli.evaluate)
app.add_typer(recipe.app, name="recipe")
app.add_typer(traj.app, name="traj")
app.add_typer(model.model_app, name="model")
app.add_typer(model.engine_app, name="engine")
app.add_typer(proxy.app, name="proxy")
app.add_typer(bench.app, name="bench")
app.add_typer(sandbox.app, name="sandbox")
app.add_typer(tasks.app, name="tasks")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"gyre-hpc {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    """Elastic online RL for long-horizon LLM agents, on Slurm or on this machine."""


def main() -> None:
    try:
        app()  # click handles its own usage errors (one line, exit 2); ours arrive here
    except GyreError as err:
        if os.environ.get("GYRE_DEBUG"):
            raise
        # The message is text, not markup: "pip install '.[megatron]'" keeps its brackets.
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
        leave(err.exit_code)
    except SystemExit as done:  # click's way out, every command's: without the interpreter's teardown
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
        leave(done.code if isinstance(done.code, int) else int(done.code is not None))
    leave(0)
