"""``gyre-hpc run RECIPE``: the whole system on this machine, under mpirun (``launch.local``), with
live progress."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from gyre_hpc.cli.model import resolve_shown
from gyre_hpc.cli.recipe import SetOption
from gyre_hpc.launch.check import check_launch
from gyre_hpc.launch.ending import resume_hint
from gyre_hpc.launch.local import LocalRun
from gyre_hpc.launch.start import load_run, open_run
from gyre_hpc.observability import events as ev
from gyre_hpc.plan.ranks import RankLayout

EXIT = {"completed": 0, "failed": 1, "interrupted": 130, "preempted": 75}


def run(
    recipe: Annotated[Path | None, typer.Argument(help="Recipe TOML file.", show_default=False)] = None,
    set_: SetOption = None,
    resume: Annotated[
        Path | None,
        typer.Option(help="Continue this run directory from its newest checkpoint (same data order)."),
    ] = None,
) -> None:
    """Run a recipe locally: 1 controller + the recipe's cells as MPI ranks on this machine.

    Trains the recipe's model online: executions through the proxy, scoring, trajectory
    selection, data-parallel steps on the cells. Writes `runs/<name>-<time>/` (recipe,
    events.jsonl, tito.bin, checkpoints/, metrics.png, logs) and shows progress.
    Exit code 0 when the run completes, 1 when a rank fails (its message is printed),
    130 when interrupted (Ctrl-C or SIGTERM stop every rank within seconds), 75 when
    preempted (SIGUSR2: the step under way is checkpointed first). `run.max_restarts`
    restarts a failed world by itself; --resume continues any run directory.

    Example: `gyre-hpc run recipes/smoke.toml --set scheduler.mode=async`;
    `gyre-hpc run --resume runs/smoke-20261130-101500 --set run.steps=30`
    """
    run_dir, r = load_run(recipe, resume, set_ or [])
    check_launch(r)
    run_dir = open_run(r, run_dir, set_ or [], "mpirun")
    layout = RankLayout.from_config(r.cells)
    console = Console(stderr=True, soft_wrap=True)
    resolve_shown(r.run.model, console)  # built once here, not by every rank at once
    verb = "resuming" if resume is not None else "gyre-hpc run"
    console.print(f"[bold]{verb}[/] {layout.describe()} → [cyan]{escape(str(run_dir.path))}[/]")
    local = LocalRun(run_dir, layout, max_restarts=r.run.max_restarts, executors=r.executors.nodes)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        end = local.launch(shown(progress, layout.units, r.run.steps))
    style = {"completed": "green", "failed": "bold red"}.get(end.status, "yellow")
    # What a rank said is not markup: a gloo error names its source file in [brackets].
    reason = f": {escape(end.reason)}" if end.reason else ""
    console.print(f"[{style}]run {end.status}[/]{reason}\nrun directory: {escape(str(run_dir.path))}")
    if end.status in ("preempted", "failed", "interrupted"):
        hint = escape(resume_hint(run_dir.path, end.reason))
        console.print(hint.replace("not resumable yet", "[yellow]not resumable yet[/]", 1))
    raise typer.Exit(EXIT.get(end.status, 1))


def shown(progress: Progress, units: int, steps: int):  # noqa: ANN201 - the launcher's callback
    """The run's events as progress bars and a line per step."""
    cells = progress.add_task("cells up", total=units)
    step_bar = progress.add_task("steps", total=steps)
    executions = progress.add_task("executions (all steps)", total=None)

    def show(events: list[ev.Event]) -> None:
        for e in events:
            if isinstance(e, ev.Hello):
                progress.advance(cells)
            elif isinstance(e, ev.Finished):
                progress.update(executions, completed=e.f)
            elif isinstance(e, ev.SandboxUp) and e.warning:
                progress.console.print(f"[yellow]warning[/]: {escape(e.warning)}")
            elif isinstance(e, ev.Restarting):
                progress.reset(cells)
                progress.console.print(f"[yellow]restarting (attempt {e.attempt})[/]: {escape(e.reason)}")
            elif isinstance(e, ev.Step):
                progress.update(step_bar, completed=e.step)
                progress.console.print(
                    f"step {e.step:>3}  reward {e.reward_mean:.3f}  pass {e.pass_rate:.3f}"
                    f"  v{e.version}  {e.seconds:.1f} s"
                )

    return show
