"""``gyre-hpc submit`` and ``gyre-hpc cancel``: the run as one heterogeneous Slurm job."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gyre_hpc.cli import output
from gyre_hpc.cli.model import resolve_shown
from gyre_hpc.cli.recipe import SetOption, load, load_resumed
from gyre_hpc.cli.status import TargetArg, resolve
from gyre_hpc.errors import GyreError, LaunchError
from gyre_hpc.launch import slurm
from gyre_hpc.launch.check import check_launch
from gyre_hpc.launch.sbatch import render_sbatch
from gyre_hpc.observability import events as ev
from gyre_hpc.plan.placement import cell_engines
from gyre_hpc.plan.ranks import RankLayout
from gyre_hpc.rundir import RunDir

LOOPBACK = ("127.0.0.1", "localhost", "::1")


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
    rollout pool; `srun --mpi=pmix --het-group=0,1[,2]` starts them as one MPI world.
    Prints the job id and the run directory; --dry-run prints the script instead. The job
    checkpoints and requeues itself on SIGUSR2 (slurm.signal_grace_s before its time limit) and
    restarts a failed world up to run.max_restarts times; --resume submits a run directory again.

    Example: `gyre-hpc submit recipes/qwen3-8b-8cells.toml --set slurm.partition=h100 --dry-run`;
    `gyre-hpc submit --resume runs/qwen3-8b-20261130-101500 --set run.steps=400`
    """
    if (recipe is None) == (resume is None):
        raise GyreError("give a RECIPE, or --resume RUN_DIR (not both)")
    run_dir, r = load_resumed(resume, set_) if resume is not None else (None, load(recipe, set_))  # type: ignore[arg-type]
    layout = RankLayout.from_config(r.cells)
    python = r.slurm.python or sys.executable
    if r.executors.nodes and r.proxy.host in LOOPBACK:
        raise GyreError(
            f"executors.nodes = {r.executors.nodes} with proxy.host = {r.proxy.host!r}: executor nodes "
            'cannot reach a proxy on loopback; set proxy.host = "0.0.0.0" (or the controller\'s address)'
        )

    def script(where: Path) -> str:
        return render_sbatch(
            r.slurm,
            layout,
            job_name=r.run.name,
            run_dir=where,
            python=python,
            max_restarts=r.run.max_restarts,
            engines=cell_engines(r.cells, r.slurm, r.engine).describe(),
            executors=r.executors,
        )

    if dry_run:
        typer.echo(
            script(run_dir.path if run_dir else Path(r.run.runs_dir).resolve() / f"{r.run.name}-<time>"),
            nl=False,
        )
        return
    check_launch(r)
    resolve_shown(r.run.model, output.console(stderr=True))  # built here once, not by every rank
    if run_dir is None:
        run_dir = RunDir.create(r.run.runs_dir, r.run.name)
        run_dir.write_recipe(r)
    else:
        run_dir.add_resume(set_ or [], "slurm")
    path = run_dir.path / "job.sbatch"
    path.write_text(script(run_dir.path))
    job_id = slurm.submit(str(path))
    run_dir.write_job(launcher="slurm", job_id=job_id, script=str(path))
    with ev.EventLog(run_dir.events) as events:
        events.emit(ev.RunStart(launcher="slurm", job_id=job_id))
    typer.echo(f"submitted job {job_id}\nrun directory: {run_dir.path}")


def cancel(
    target: TargetArg = None, runs_dir: Annotated[Path, typer.Option(help="Where runs live.")] = Path("runs")
) -> None:
    """Cancel a submitted run (by run directory or job id)."""
    run_dir, job_id = resolve(target, runs_dir)
    if job_id is None:
        raise LaunchError(
            f"{run_dir.path if run_dir else target} was not submitted to Slurm; stop a local run with Ctrl-C"
        )
    slurm.cancel(job_id)
    Console().print(f"cancelled job {job_id}")
