"""``gyre-hpc tasks check``: read a suite (our JSONL, SWE-bench-style JSONL, a Harbor task or
dataset directory) and say what is wrong with it, without running anything;
``gyre-hpc tasks verify``: run each task's reference solution and an empty attempt through the
task's own scorer, in the sandbox — a task whose reference does not earn 1.0, or whose empty
attempt earns more than 0, would teach the policy nothing true.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gyre_hpc.agents import reference
from gyre_hpc.agents.dispatch import setup
from gyre_hpc.cli import output
from gyre_hpc.cli.recipe import SetOption
from gyre_hpc.errors import GyreError
from gyre_hpc.recipe import load_recipe
from gyre_hpc.sandbox.confine import Sandbox, for_run
from gyre_hpc.scoring import RunArtifacts, ScoringRunners
from gyre_hpc.tasks.harbor import read_task, task_dirs
from gyre_hpc.tasks.suites import load_suite
from gyre_hpc.tasks.task import Task

app = typer.Typer(help="Check and verify task suites in the formats users bring.", no_args_is_help=True)
SuiteArg = Annotated[
    Path, typer.Argument(help="A JSONL file (ours or SWE-bench-style) or a Harbor directory.")
]


@app.command()
def check(suite: SuiteArg) -> None:
    """Validate every task of SUITE without running it: one line per task, notes on what of it
    does not run as written here; the first malformed task is one line naming its file and field
    (exit 2, as every user error)."""
    suite = suite.resolve()
    if suite.is_dir():
        found = [read_task(d) for d in task_dirs(suite)]
    elif suite.is_file():
        found = [(t, []) for t in load_suite(str(suite), 0)]
    else:
        raise GyreError(f"{suite}: no such file or directory (a JSONL suite or a Harbor directory)")
    for task, notes in found:
        scorer = task.scorer or "the recipe's scoring.scorer"
        typer.echo(f"ok  {task.id}  ({task.format or 'jsonl'}, scored by {scorer})")
        for note in notes:
            typer.echo(f"    note: {note}")
    typer.echo(f"{len(found)} task{'s' * (len(found) != 1)} in {suite}")


@app.command()
def verify(
    suite: SuiteArg,
    recipe: Annotated[
        Path | None, typer.Option("--recipe", help="Its [agent] and [scoring]; default: defaults.")
    ] = None,
    set_: SetOption = None,
) -> None:
    """Score each task's reference solution (expect 1.0) and an empty attempt (expect 0.0), in
    the sandbox the recipe's `agent.sandbox` names; exit 2 if any task misses either."""
    r = load_recipe(recipe, [*(set_ or []), f"tasks.suite={suite.resolve()}"])
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    sandbox = for_run(r.agent, None, r.tasks.suite, lambda line: console.print(f"warning: {line}"),
                      scoring_binds=r.scoring.sandbox_binds)  # fmt: skip
    runners = ScoringRunners(r.scoring)
    table = Table("task", "reference", "empty", "verdict")
    bad = 0
    for task in load_suite(r.tasks.suite, 0):
        with tempfile.TemporaryDirectory(prefix="gyre-verify-") as tmp:
            got = {}
            for attempt in ("reference", "empty"):
                if attempt == "reference" and not reference.has_reference(task):
                    got[attempt] = None, "no reference solution"
                    continue
                got[attempt] = _score(task, Path(tmp) / attempt, sandbox, runners, r.agent.command_timeout_s,
                                      attempt == "reference")  # fmt: skip
        ref, empty = got["reference"], got["empty"]
        good = (ref[0] is None and ref[1] == "no reference solution" or ref[0] == 1.0) and empty[0] == 0.0
        bad += not good
        table.add_row(task.id, _cell(ref), _cell(empty), "ok" if good else "[red]wrong[/]")
    output.console(highlight=False).print(table)
    if bad:
        raise GyreError(
            f"{bad} task{'s' * (bad != 1)}: a reference short of 1.0, or an empty attempt above 0"
        )


def _score(
    task: Task, workspace: Path, sandbox: Sandbox, runners: ScoringRunners, timeout_s: float, solve: bool
) -> tuple[float | None, str]:
    """What ``task``'s scorer gives a fresh workspace, with its reference applied if ``solve``."""
    task.materialize(workspace)
    sandbox.for_task(task).seed(workspace)
    if (failed := asyncio.run(setup(task, workspace))) is not None:
        return None, failed
    sandbox.prepare(workspace)
    if solve and (failed := reference.apply(task, workspace, sandbox, timeout_s)) is not None:
        return None, failed
    sandbox.prepare(workspace)
    with tempfile.TemporaryDirectory(prefix="gyre-verify-task-") as tasks:
        artifacts = RunArtifacts(f"verify-{task.id}", workspace, "finished", task.for_scorer(Path(tasks)),
                                 sandbox.for_task(task))  # fmt: skip
        result = runners.get(task.scorer).score(artifacts)
    return result.reward, result.reason


def _cell(got: tuple[float | None, str]) -> str:
    value, why = got
    text = "-" if value is None else f"{value:.3f}"
    return f"{text} ({why[:80]})" if why else text
