"""``gyre-hpc status [RUN_DIR|JOBID]``: a run's state from its directory and Slurm, live or once."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.live import Live

from gyre_hpc.cli import output
from gyre_hpc.errors import GyreError
from gyre_hpc.launch import slurm
from gyre_hpc.observability.events import read_events
from gyre_hpc.rundir import RunDir
from gyre_hpc.tui.status import RunView, render, requeued

TargetArg = Annotated[
    str | None,
    typer.Argument(help="Run directory or Slurm job id; default: the newest run.", show_default=False),
]


def resolve(target: str | None, runs_dir: Path) -> tuple[RunDir | None, str | None]:
    """(run directory, job id) for a run directory, a job id, or nothing (the newest run)."""
    if target is None:
        runs = [r for r in RunDir.under(runs_dir) if r.events.exists()]
        if not runs:
            raise GyreError(f"no runs in {runs_dir}/; give a run directory or a job id")
        run_dir = runs[-1]
        return run_dir, run_dir.read_job().get("job_id")
    if Path(target).is_dir():
        run_dir = RunDir(Path(target))
        if not run_dir.events.exists() and not run_dir.recipe_path.exists():
            raise GyreError(
                f"{target} is not a run directory (no {run_dir.events.name} or {run_dir.recipe_path.name})"
            )
        return run_dir, run_dir.read_job().get("job_id")
    if target.isdigit():
        for run_dir in RunDir.under(runs_dir):
            if str(run_dir.read_job().get("job_id")) == target:
                return run_dir, target
        return None, target
    raise GyreError(f"{target!r} is neither a run directory nor a Slurm job id")


def status(
    target: TargetArg = None,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit (scripts, CI).")] = False,
    runs_dir: Annotated[Path, typer.Option(help="Where to look for runs.")] = Path("runs"),
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.", min=0.1)] = 1.0,
) -> None:
    """Show a run: job state, cells and their roles, steps, recent events.

    Reads only the run directory (and sacct/squeue), so it works from a login node and on
    finished runs. Without --once it refreshes until the run ends.

    Examples: `gyre-hpc status --once`, `gyre-hpc status runs/smoke-20261130-120000`, `gyre-hpc status 4242`
    """
    run_dir, job_id = resolve(target, runs_dir)
    watcher = slurm.HetJobWatcher(delay_s=30)
    if run_dir is None and slurm.job_state(job_id, watcher).state == "UNKNOWN":
        raise GyreError(
            f"job {job_id}: Slurm knows no such job (neither queued nor in accounting) and no run "
            f"directory in {runs_dir}/ names it"
        )

    def frame(mode: str = "standard") -> tuple[object, bool]:
        job = slurm.job_state(job_id, watcher, mode) if job_id else None
        if run_dir is None:
            view = RunView.fold(f"job {job_id}", 0, [])
        else:
            steps = run_dir.read_recipe().run.steps if run_dir.recipe_path.exists() else 0
            view = RunView.fold(run_dir.path.name, steps, read_events(run_dir.events))
        ended = view.status in ("completed", "failed", "interrupted", "preempted")
        done = (ended and requeued(view, job) != "requeued") or (job is not None and run_dir is None)
        return render(view, job, str(run_dir.path) if run_dir else ""), done

    console = output.console()
    if once:
        console.print(frame("force")[0])
        return
    with Live(frame("force")[0], console=console, refresh_per_second=4) as live:
        while True:
            renderable, done = frame()
            live.update(renderable)
            if done:
                return
            time.sleep(interval)
