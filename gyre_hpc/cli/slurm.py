"""``gyre-hpc submit`` and ``gyre-hpc cancel``: the run as one heterogeneous Slurm job
(``launch.submit``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gyre_hpc.cli import output
from gyre_hpc.cli.model import resolve_shown
from gyre_hpc.cli.recipe import SetOption
from gyre_hpc.cli.status import TargetArg
from gyre_hpc.errors import LaunchError
from gyre_hpc.launch import slurm
from gyre_hpc.launch.check import check_launch
from gyre_hpc.launch.start import load_run, open_run
from gyre_hpc.launch.submit import job_script, submit_run
from gyre_hpc.rundir import find_run


def submit(
    recipe: Annotated[Path | None, typer.Argument(help="Recipe TOML file.", show_default=False)] = None,
    set_: SetOption = None,
    resume: Annotated[
        Path | None,
        typer.Option(help="Submit this run directory again: it continues from its newest checkpoint."),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the sbatch script; submit nothing.")
    ] = False,
) -> None:
    """Submit a recipe as ONE heterogeneous sbatch job: controller + cells in one MPI world.

    Component 0 runs the controller (1 task), component 1 the cells, component 2 the optional
    rollout pool, a last one the optional executor nodes; one `srun --mpi=pmix` whose
    `:`-separated parts name each component (`--het-group=N`) starts the MPI world.
    Prints the job id and the run directory; --dry-run prints the script instead. The job
    checkpoints and requeues itself on SIGUSR2 (slurm.signal_grace_s before its time limit) and
    restarts a failed world up to run.max_restarts times; --resume submits a run directory again.

    Example: `gyre-hpc submit recipes/qwen3-8b-8cells.toml --set slurm.partition=h100 --dry-run`;
    `gyre-hpc submit --resume runs/qwen3-8b-20261130-101500 --set run.steps=400`
    """
    run_dir, r = load_run(recipe, resume, set_ or [])
    if dry_run:
        where = run_dir.path if run_dir else Path(r.run.runs_dir).resolve() / f"{r.run.name}-<time>"
        typer.echo(job_script(r, where), nl=False)
        return
    check_launch(r)
    resolve_shown(r.run.model, output.console(stderr=True))  # built here once, not by every rank
    run_dir = open_run(r, run_dir, set_ or [], "slurm")
    job_id = submit_run(r, run_dir)
    typer.echo(f"submitted job {job_id}\nrun directory: {run_dir.path}")


def cancel(
    target: TargetArg = None, runs_dir: Annotated[Path, typer.Option(help="Where runs live.")] = Path("runs")
) -> None:
    """Cancel a submitted run (by run directory or job id)."""
    run_dir, job_id = find_run(target, runs_dir)
    if job_id is None:
        raise LaunchError(
            f"{run_dir.path if run_dir else target} was not submitted to Slurm; stop a local run with Ctrl-C"
        )
    slurm.cancel(job_id)
    Console().print(f"cancelled job {job_id}")
