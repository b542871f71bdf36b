"""``gyre-hpc eval RECIPE``: run a task suite against the recipe's model through the proxy."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gyre_hpc.agents.dispatch import Dispatcher, make_harness
from gyre_hpc.agents.external import Endpoint
from gyre_hpc.cli import output
from gyre_hpc.cli.model import resolve_shown
from gyre_hpc.cli.output import CsvOption, JsonOption, Results, chosen
from gyre_hpc.cli.recipe import RecipeArg, SetOption, load
from gyre_hpc.execution.outcome import Outcome, group_rewards, mean_reward, pass_rate
from gyre_hpc.execution.run_id import eval_run_id
from gyre_hpc.observability import events as ev
from gyre_hpc.proxy.loopback import LocalServing
from gyre_hpc.recipe.schema import Recipe
from gyre_hpc.rundir import RunDir
from gyre_hpc.sandbox.confine import for_run
from gyre_hpc.scoring import ScoringRunners
from gyre_hpc.tasks.suites import load_suite
from gyre_hpc.tasks.task import Task


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
    results = Results(chosen(as_json, as_csv))
    r = load(recipe, set_)
    tasks = load_suite(suite or r.tasks.suite, n or r.tasks.eval_n, seed=r.run.seed, split=split)
    run_dir = RunDir.create(r.run.runs_dir, f"{r.run.name}-eval")
    run_dir.write_recipe(r)
    console = output.console(stderr=True, soft_wrap=True)
    console.print(
        f"[bold]gyre-hpc eval[/] {len(tasks)} tasks of {suite or r.tasks.suite} ({split}) "
        f"with {r.run.model} → [cyan]{run_dir.path}[/]"
    )
    model = resolve_shown(r.run.model, console)
    outcomes = asyncio.run(_run(r, model, tasks, suite or r.tasks.suite, run_dir, console))
    summary = summarize(outcomes)
    run_dir.executions.write_text("".join(json.dumps(o.to_json()) + "\n" for o in outcomes))
    run_dir.eval_summary.write_text(json.dumps(summary, indent=1) + "\n")
    table = Table(title=f"{summary['tasks']} tasks, {r.run.model}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), f"{value:.3f}" if isinstance(value, float) else str(value))
    results.table(table)
    console.print(f"run directory: {run_dir.path}  (trees: gyre-hpc traj show {run_dir.path})")


async def _run(
    r: Recipe, model: Path, tasks: list[Task], suite: str, run_dir: RunDir, console: Console
) -> list[Outcome]:
    sampling = {
        "temperature": r.engine.temperature,
        "top_p": r.engine.top_p,
        "max_tokens": r.engine.max_new_tokens,
    }
    runners = ScoringRunners(r.scoring)

    events = ev.EventLog(run_dir.events)
    counters = {"dispatched": 0, "started": 0, "finished": 0}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        bar = progress.add_task("executions", total=len(tasks))

        def on_event(kind: str, run_id: str) -> None:
            counters[kind] += 1
            d, p, f = counters.values()
            if kind == "dispatched":
                events.emit(ev.Dispatched(run=run_id, d=d, p=p, f=f))
            elif kind == "finished":
                events.emit(ev.Finished(run=run_id, d=d, p=p, f=f))
                progress.advance(bar)

        async with LocalServing(model, run_dir.path, r.cells.count, r.proxy, r.cells.capacity) as serving:
            endpoint = Endpoint(serving.proxy_url, serving.key, model.name, serving.proxy.usage)
            sandbox = for_run(
                r.agent,
                run_dir.path,
                suite,  # the suite evaluated: its hidden tests are hidden
                lambda w: console.print(f"warning: {w}"),
                scoring_binds=r.scoring.sandbox_binds,
            )
            logs = run_dir.execution_logs
            harness = make_harness(r.agent, endpoint, sampling, r.run.seed, logs, sandbox)
            dispatcher = Dispatcher(
                harness,
                lambda task: runners.get(task.scorer),
                run_dir.workspaces,
                run_dir.task_files,
                r.cells.count * r.cells.capacity,
                on_event,
            )
            jobs = [(eval_run_id(t.id), t) for t in tasks]
            outcomes = await dispatcher.run_all(jobs)
    events.close()
    return outcomes


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    rewards = group_rewards(outcomes)
    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[o.score.kind] = kinds.get(o.score.kind, 0) + 1
    n = max(len(outcomes), 1)
    return {
        "tasks": len(outcomes),
        "pass_rate": pass_rate(rewards),
        "mean_score": mean_reward(rewards),
        "scoring": ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())),
        "statuses": ", ".join(
            f"{s} {sum(1 for o in outcomes if o.execution.status == s)}"
            for s in sorted({o.execution.status for o in outcomes})
        ),
        "calls_per_execution": sum(o.execution.calls for o in outcomes) / n,
        "tokens_per_execution": sum(o.execution.tokens for o in outcomes) / n,
        "seconds_per_execution": sum(o.execution.seconds for o in outcomes) / n,
    }
