"""``gyre-hpc traj show RUN_DIR``: the trajectory trees of a run's executions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.tree import Tree

from gyre_hpc.cli import output
from gyre_hpc.errors import GyreError
from gyre_hpc.recipe.schema import Recipe
from gyre_hpc.rundir import RunDir
from gyre_hpc.trajectory.codec import by_run, read_records
from gyre_hpc.trajectory.view import Segment, run_views

app = typer.Typer(help="Inspect trajectory trees.", no_args_is_help=True)


@app.command()
def show(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (holds the TITO log).", show_default=False)],
    run: Annotated[str | None, typer.Option("--run", help="Only this execution (run id).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a tree.")] = False,
) -> None:
    """Show each execution's trajectory tree: roles, token and trainable counts, selected paths.

    Chains of calls that only extend each other are collapsed into one line. Selection uses the
    run's recipe (`trajectory.jmax`, `trajectory.priority`, `run.seed`).

    Example: `gyre-hpc traj show runs/smoke-20261130-120000 --run smoke-p0-g1`
    """
    rd = RunDir(run_dir)
    if not rd.tito_log.exists():
        raise GyreError(
            f"{run_dir} has no TITO log ({rd.tito_log.name}): not a run directory, or no calls yet"
        )
    reads = [read_records(segment) for segment in rd.tito_segments()]  # one log, however many segments
    runs = dict(by_run(r for read in reads for r in read.records))
    if run is not None:
        if run not in runs:
            raise GyreError(f"no run {run!r} in {rd.tito_log}; runs: {', '.join(sorted(runs)[:20])}")
        runs = {run: runs[run]}
    recipe = rd.read_recipe() if rd.recipe_path.exists() else Recipe()
    traj = recipe.trajectory
    views = run_views(runs.items(), traj.jmax, traj.priority, recipe.run.seed)
    if as_json:
        typer.echo(json.dumps([v.to_dict() for v in views], indent=1))
        return
    console = output.console()
    for view in views:
        tree = view.tree
        root = Tree(
            f"[bold]{view.run_id}[/] · {tree.num_records} calls · {tree.num_unique_tokens:,} unique tokens "
            f"({tree.num_record_tokens:,} sent) · {tree.num_trainable_tokens:,} trainable"
        )
        for seg in view.segments:
            _add(root, seg)
        console.print(root)
    if torn := sum(read.torn_bytes for read in reads):
        console.print(f"[yellow]{torn} bytes of a torn last record were ignored[/]")


def _add(parent: Tree, seg: Segment) -> None:
    calls = ", ".join(f"{role} ×{n}" for role, n in seg.calls.items()) or "no call ends here"
    span = f"[{seg.depth_start:,}–{seg.depth_end:,})"
    label = f"{seg.tokens:,} tokens {span} · {seg.trainable:,} trainable · {calls}"
    if seg.leaf_role:
        label += f" · [bold]leaf {seg.leaf_role}[/]"
    for order, loss_tokens in seg.selected:
        label += f" · [green]selected #{order} ({loss_tokens:,} loss tokens)[/]"
    node = parent.add(label)
    for child in seg.children:
        _add(node, child)
