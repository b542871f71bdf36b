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
from gyre_hpc.rundir import find_run
from gyre_hpc.tui.status import RunView, render, requeued

TargetArg = Annotated[
    str | None,
    typer.Argument(help="Run directory or Slurm job id; default: the newest run.", show_default=False),
]


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
    run_dir, job_id = find_run(target, runs_dir)
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
