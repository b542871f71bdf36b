"""``gyre-hpc run RECIPE``: the whole system on this machine, under mpirun, with live progress."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

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

from gyre_hpc.cli.model import resolve_shown
from gyre_hpc.cli.recipe import SetOption, load, load_resumed
from gyre_hpc.diskspace import MIB, free_bytes
from gyre_hpc.errors import GyreError
from gyre_hpc.launch.check import check_launch
from gyre_hpc.launch.local import LocalRun
from gyre_hpc.observability import events as ev
from gyre_hpc.plan.ranks import RankLayout
from gyre_hpc.rundir import RunDir

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
    if (recipe is None) == (resume is None):
        raise GyreError("give a RECIPE, or --resume RUN_DIR (not both)")
    if resume is not None:
        run_dir, r = load_resumed(resume, set_)
        check_launch(r)
        run_dir.add_resume(set_ or [], "mpirun")  # recipe.toml stays as the run was created
    else:
        r = load(recipe, set_)  # type: ignore[arg-type]
        check_launch(r)
        run_dir = RunDir.create(r.run.runs_dir, r.run.name)
        run_dir.write_recipe(r)
    layout = RankLayout.from_config(r.cells)
    console = Console(stderr=True, soft_wrap=True)
    resolve_shown(r.run.model, console)  # built once here, not by every rank at once
    verb = "resuming" if resume is not None else "gyre-hpc run"
    console.print(f"[bold]{verb}[/] {layout.describe()} → [cyan]{run_dir.path}[/]")
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
        executions = progress.add_task("executions (all steps)", total=None)

        def show(events: list[ev.Event]) -> None:
            for e in events:
                if isinstance(e, ev.Hello):
                    progress.advance(cells)
                elif isinstance(e, ev.Finished):
                    progress.update(executions, completed=e.f)
                elif isinstance(e, ev.SandboxUp) and e.warning:
                    progress.console.print(f"[yellow]warning[/]: {e.warning}")
                elif isinstance(e, ev.Restarting):
                    progress.reset(cells)
                    progress.console.print(f"[yellow]restarting (attempt {e.attempt})[/]: {e.reason}")
                elif isinstance(e, ev.Step):
                    progress.update(steps, completed=e.step)
                    progress.console.print(
                        f"step {e.step:>3}  reward {e.reward_mean:.3f}  pass {e.pass_rate:.3f}"
                        f"  v{e.version}  {e.seconds:.1f} s"
                    )

        end = LocalRun(run_dir, layout, max_restarts=r.run.max_restarts, executors=r.executors.nodes).launch(
            show
        )
    style = {"completed": "green", "failed": "bold red"}.get(end.status, "yellow")
    reason = f": {end.reason}" if end.reason else ""
    console.print(f"[{style}]run {end.status}[/]{reason}\nrun directory: {run_dir.path}")
    if end.status in ("preempted", "failed", "interrupted"):
        console.print(resume_hint(run_dir.path, end.reason))
    raise typer.Exit(EXIT.get(end.status, 1))


def resume_hint(run_dir: Path, reason: str) -> str:
    """How to continue the run; on a disk still too full to take a checkpoint, what to free
    instead (a --resume there would fail the same way)."""
    if "no space left on device" in reason:
        free = free_bytes(run_dir) / MIB
        needed = re.search(r"needs (\d+) MiB", reason)
        if needed is None or free < int(needed[1]):
            return f"[yellow]not resumable yet[/]: {free:.0f} MiB free under {run_dir}; make room first"
    return f"continue it: gyre-hpc run --resume {run_dir}"
