"""``gyre-hpc eval RECIPE``: run a task suite against the recipe's model through the proxy
(``evaluation.evaluate``)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gyre_hpc.cli import output
from gyre_hpc.cli.model import resolve_shown
from gyre_hpc.cli.output import CsvOption, JsonOption, Results, chosen
from gyre_hpc.cli.recipe import RecipeArg, SetOption, load
from gyre_hpc.rundir import RunDir


def evaluate(
    recipe: RecipeArg,
    set_: SetOption = None,
    suite: Annotated[str | None, typer.Option(help="Suite name or JSONL; default: tasks.suite.")] = None,
    n: Annotated[int | None, typer.Option(help="Tasks to run; default: tasks.eval_n.")] = None,
    split: Annotated[str, typer.Option(help="train or heldout tasks of a built-in suite.")] = "heldout",
    as_json: JsonOption = False,
    as_csv: CsvOption = False,
) -> None:
    """Evaluate the recipe's model on a suite: pass rate, partial scores, calls and tokens.

    Engines and the proxy run on this machine; every execution goes through the proxy like a
    black-box harness would, and its TITO log, scores and trees land in a run directory.

    Example: `gyre-hpc eval recipes/smoke.toml --set run.model=tiny-warm --n 32`
    """
    from gyre_hpc.evaluation.evaluate import SuiteEval  # engines, torch: only when it runs
    from gyre_hpc.tasks.suites import load_suite

    results = Results(chosen(as_json, as_csv))
    r = load(recipe, set_)
    suite = suite or r.tasks.suite
    tasks = load_suite(suite, n or r.tasks.eval_n, seed=r.run.seed, split=split)
    run_dir = RunDir.create(r.run.runs_dir, f"{r.run.name}-eval")
    run_dir.write_recipe(r)
    console = output.console(stderr=True, soft_wrap=True)
    what = f"{len(tasks)} tasks of {suite} ({split}) with {r.run.model}"
    console.print(f"[bold]gyre-hpc eval[/] {what} → [cyan]{run_dir.path}[/]")
    model = resolve_shown(r.run.model, console)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("executions", total=len(tasks))
        shown = lambda kind, run: kind == "finished" and progress.advance(bar)  # noqa: E731
        warn = lambda line: console.print(f"warning: {line}")  # noqa: E731
        evaluation = SuiteEval(recipe=r, model=model, tasks=tasks, suite=suite, run_dir=run_dir)
        summary = evaluation.run(shown, warn)
    table = Table(title=f"{summary['tasks']} tasks, {r.run.model}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), f"{value:.3f}" if isinstance(value, float) else str(value))
    results.table(table)
    console.print(f"run directory: {run_dir.path}  (trees: gyre-hpc traj show {run_dir.path})")
