"""``gyre-hpc sandbox exec``: one command in an execution's sandbox, as its tool call would run;
``gyre-hpc sandbox score``: a workspace scored as the run scores the execution that left it.

For debugging a task's environment on the node that runs it: what the model's ``run_shell``
sees, with the same sandbox, limits, environment and timeout; and what a workspace earns (a
task's reference solution should earn 1.0). A workspace inside a run directory takes that
run's recipe (its ``[agent]`` and ``[scoring]`` sections) and hides that run, as the run does.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from gyre_hpc.cli.recipe import SetOption
from gyre_hpc.errors import GyreError
from gyre_hpc.launch.start import recipe_in_force
from gyre_hpc.recipe import Recipe, load_recipe
from gyre_hpc.rundir import RunDir
from gyre_hpc.tasks.suites import find_task

if TYPE_CHECKING:  # the sandbox, the harness and scoring load when a command runs
    from gyre_hpc.sandbox.confine import Sandbox

app = typer.Typer(help="Run commands as an execution's tool calls run them.", no_args_is_help=True)
RecipeOption = Annotated[
    Path | None, typer.Option("--recipe", help="Recipe; default: the run's, if the workspace is in one.")
]


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exec(  # noqa: A001 - the verb users type
    ctx: typer.Context,
    workspace: Annotated[
        Path, typer.Option("--workspace", help="The execution's workspace.", show_default=False)
    ],
    task: Annotated[
        str | None, typer.Option("--task", help="Seed an empty workspace with this task (id in tasks.suite).")
    ] = None,
    recipe: RecipeOption = None,
    set_: SetOption = None,
) -> None:
    """Run `-- COMMAND …` in the workspace's sandbox (`agent.sandbox`) with the agent's limits;
    print its output and exit with its exit code.

    Example: `gyre-hpc sandbox exec --workspace runs/smoke-…/workspaces/step-0001/smoke-0-0-g0 -- ls -la`
    """
    from gyre_hpc.agents.workspace import Workspace
    from gyre_hpc.evaluation.verify import seed

    command = ctx.args[1:] if ctx.args[:1] == ["--"] else ctx.args
    if not command:
        raise GyreError("no command: give it after --, e.g. gyre-hpc sandbox exec --workspace DIR -- ls")
    workspace = workspace.resolve()
    run = RunDir.enclosing(workspace)
    r = _recipe(recipe, run, set_ or [])
    found = find_task(r.tasks.suite, r.run.seed, task) if task is not None else None
    fresh = not workspace.exists() or not any(workspace.iterdir())  # else: inspect it as it was left
    if found is not None and fresh and (failed := seed(found, workspace)) is not None:
        raise GyreError(f"task {found.id}: {failed}")
    if not workspace.is_dir():
        raise GyreError(f"--workspace {workspace} does not exist (give --task to seed a new one)")
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    sandbox = _sandbox(r, run, console)
    sandbox.prepare(workspace)
    if found is not None:
        sandbox = sandbox.for_task(found)  # where the task's own commands see it (a Harbor task: /app)
    line = command[0] if len(command) == 1 else shlex.join(command)  # one argument: a shell line
    result = Workspace(workspace, sandbox, max_output_bytes=1 << 30).run(line, r.agent.command_timeout_s)
    typer.echo(result.output, nl=False)
    if result.timed_out:
        console.print(f"timed out after {r.agent.command_timeout_s:g} s (agent.command_timeout_s): killed")
    console.print(f"sandbox: {sandbox.kind}  exit code {result.exit_code}", style="dim")
    raise typer.Exit(124 if result.timed_out else result.exit_code)


@app.command()
def score(
    workspace: Annotated[
        Path, typer.Option("--workspace", help="The workspace to score.", show_default=False)
    ],
    task: Annotated[
        str, typer.Option("--task", help="The task it is for (an id in tasks.suite).", show_default=False)
    ],
    recipe: RecipeOption = None,
    set_: SetOption = None,
) -> None:
    """Score a workspace as the run scores an execution that finished in it (its task's scorer,
    in the scoring sandbox, on a copy); print the kind, the reward and why.

    Example: `gyre-hpc sandbox score --recipe r.toml --set tasks.suite=my.jsonl --task calc --workspace ref/`
    """
    from gyre_hpc.evaluation.verify import score_workspace
    from gyre_hpc.scoring import ScoringRunners

    workspace = workspace.resolve()
    if not workspace.is_dir():
        raise GyreError(f"--workspace {workspace} does not exist")
    run = RunDir.enclosing(workspace)
    r = _recipe(recipe, run, set_ or [])
    found = find_task(r.tasks.suite, r.run.seed, task)
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    result = score_workspace(found, workspace, _sandbox(r, run, console), ScoringRunners(r.scoring))
    reward = "no reward" if result.reward is None else f"{result.reward:.3f}"
    scorer = found.scorer or r.scoring.scorer
    typer.echo(f"{result.kind} {reward} ({scorer}, {result.attempts} attempt{'s' * (result.attempts != 1)})")
    if result.reason:
        typer.echo(f"why: {result.reason}")


def _sandbox(r: Recipe, run: RunDir | None, console: Console) -> Sandbox:
    from gyre_hpc.sandbox.confine import for_run

    return for_run(
        r.agent,
        run.path if run else None,
        r.tasks.suite,
        lambda line: console.print(f"warning: {line}"),
        scoring_binds=r.scoring.sandbox_binds,
    )


def _recipe(path: Path | None, run: RunDir | None, sets: list[str]) -> Recipe:
    if path is not None:
        return load_recipe(path, sets)
    if run is not None:
        return recipe_in_force(run, sets)
    return load_recipe(None, sets)
