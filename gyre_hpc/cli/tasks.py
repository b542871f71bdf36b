"""``gyre-hpc tasks check``: read a suite (our JSONL, SWE-bench-style JSONL, a Harbor task or
dataset directory) and say what is wrong with it, without running anything;
``gyre-hpc tasks verify``: each task's reference solution and an empty attempt through the
task's own scorer, in the sandbox (``evaluation.verify``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gyre_hpc.cli import output
from gyre_hpc.cli.recipe import SetOption
from gyre_hpc.errors import GyreError
from gyre_hpc.recipe import load_recipe

app = typer.Typer(help="Check and verify task suites in the formats users bring.", no_args_is_help=True)
SuiteArg = Annotated[
    Path, typer.Argument(help="A JSONL file (ours or SWE-bench-style) or a Harbor directory.")
]


@app.command()
def check(suite: SuiteArg) -> None:
    """Validate every task of SUITE without running it: one line per task, notes on what of it
    does not run as written here; the first malformed task is one line naming its file and field
    (exit 2, as every user error)."""
    from gyre_hpc.tasks.harbor import read_task, task_dirs
    from gyre_hpc.tasks.suites import load_suite

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
    from gyre_hpc.evaluation.verify import verify_task  # the harness, scoring: only when it runs
    from gyre_hpc.sandbox.confine import for_run
    from gyre_hpc.scoring import ScoringRunners
    from gyre_hpc.tasks.suites import load_suite

    r = load_recipe(recipe, [*(set_ or []), f"tasks.suite={suite.resolve()}"])
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    sandbox = for_run(r.agent, None, r.tasks.suite, lambda line: console.print(f"warning: {line}"),
                      scoring_binds=r.scoring.sandbox_binds)  # fmt: skip
    runners = ScoringRunners(r.scoring)
    table = Table("task", "reference", "empty", "verdict")
    bad = 0
    for task in load_suite(r.tasks.suite, 0):
        v = verify_task(task, sandbox, runners, r.agent.command_timeout_s)
        bad += not v.good
        verdict = "ok" if v.good else "[red]wrong[/]"
        table.add_row(task.id, _cell(v.reference, v.reference_why), _cell(v.empty, v.empty_why), verdict)
    output.console(highlight=False).print(table)
    if bad:
        raise GyreError(
            f"{bad} task{'s' * (bad != 1)}: a reference short of 1.0, or an empty attempt above 0"
        )


def _cell(value: float | None, why: str) -> str:
    text = "-" if value is None else f"{value:.3f}"
    return f"{text} ({why[:80]})" if why else text
