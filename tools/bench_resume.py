#!/usr/bin/env python3
"""What a restart costs the step it interrupts: continuing journalled executions vs sampling the
step again from scratch, measured side by side on the smoke recipe.

Each side runs one step of the smoke world, kills the controller's rank once ``--at`` of the
step's executions have finished (a node lost mid-step), and resumes the run directory. The
figure is the resumed step's sampling time (``step.sample_seconds``: from the step's start to
its last execution's end; bringing the world up again is the same on both sides and excluded).
With ``agent.journal`` the finished executions are kept and those under way continue from their
last call; without it every execution of the step runs again. A straight, uninterrupted step is
the reference: restarting from scratch costs about one whole step, the bound continuing tends
to is the longest remaining tail.

    python tools/bench_resume.py [--at 0.8] [--repeat 1] [--set agent.max_calls=6 ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gyre_hpc.observability import events as ev
from gyre_hpc.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "recipes" / "smoke.toml"
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def gyre(*args: str, wait: bool = True) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre_hpc", *args],
        cwd=REPO,
        env={**os.environ, **ROOT_OK},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if wait:
        proc.wait()
    return proc


def events(run: RunDir) -> list[ev.Event]:
    try:
        return run.read_events()
    except OSError:
        return []


def wait(predicate, timeout: float = 600) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.05)


def one(runs: Path, sets: list[str], at: float | None) -> tuple[float, ev.Resumed | None]:
    """The step's sampling seconds (after a kill at ``at`` and a resume when given)."""
    args = ["run", str(SMOKE), "--set", f"run.runs_dir={runs}", "--set", "run.steps=1"]
    for s in sets:
        args += ["--set", s]
    proc = gyre(*args, wait=at is None)
    wait(lambda: any(runs.iterdir()))
    run = RunDir(next(runs.iterdir()))
    if at is not None:
        wait(lambda: run.recipe_path.exists())
        tasks = run.read_recipe().tasks
        total = tasks.prompts_per_step * tasks.group_size
        wait(lambda: sum(isinstance(e, ev.Finished) for e in events(run)) >= at * total)
        os.kill(next(r["pid"] for r in run.read_ranks() if r["rank"] == 0), signal.SIGKILL)
        proc.wait()
        gyre("run", "--resume", str(run.path))
    step = next(e for e in events(run) if isinstance(e, ev.Step))
    resumed = next((e for e in events(run) if isinstance(e, ev.Resumed)), None)
    return step.sample_seconds, resumed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--at", type=float, default=0.8, help="fraction of the step's executions finished")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="recipe override")
    a = ap.parse_args()
    console = Console()
    table = Table(title=f"one smoke step, controller killed at {a.at:.0%} of its executions, resumed")
    for col in ("side", "step sampling s", "vs straight", "kept finished", "continued", "records cut"):
        table.add_column(col, justify="right" if col != "side" else "left")
    sides = [
        ("straight (no fault)", a.sets, None),
        ("resume, journal (continue)", [*a.sets, "agent.journal=true"], a.at),
        ("resume, no journal (from scratch)", [*a.sets, "agent.journal=false"], a.at),
    ]
    straight = 0.0
    for name, sets, at in sides:
        for _ in range(a.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                with console.status(name):
                    seconds, resumed = one(Path(tmp), sets, at)
            straight = straight or seconds
            r = resumed or ev.Resumed(step=1, version=0)
            table.add_row(
                name, f"{seconds:.2f}", f"{seconds / straight:.2f}×",
                str(r.kept_finished), str(r.continued), str(r.dropped_records),
            )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
