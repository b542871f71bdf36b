#!/usr/bin/env python3
"""What watching a run costs: the smoke run's step time with the trackers (TensorBoard and an
offline W&B run) and without, side by side, and the trackers' own time per step.

Runs alternate (without, with, without, with, …) on the same seed, so drift on a loaded machine
falls on both sides. The figure is the mean step time over steps 2… (step 1 warms caches up);
the direct cost is each run's step records written again into fresh trackers and timed, which
is what the controller spends on them between steps. The diagnostics in the step event are
measured in either case: they are not optional.

    python tools/bench_trackers.py [--steps 4] [--pairs 2] [--set tasks.prompts_per_step=8 ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

from rich.console import Console
from rich.table import Table

from gyre_hpc.observability import events as ev
from gyre_hpc.observability.tracking import TensorBoard, Trackers, WandB
from gyre_hpc.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "recipes" / "smoke.toml"
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
WITH = ["observability.tensorboard=true", "observability.wandb_project=gyre-bench"]
WITHOUT = ["observability.tensorboard=false", 'observability.wandb_project=""']


def run(root: Path, steps: int, sets: list[str]) -> RunDir:
    args = ["run", str(SMOKE), "--set", f"run.runs_dir={root}", "--set", f"run.steps={steps}",
            "--set", "tasks.eval_every=0"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run([sys.executable, "-m", "gyre_hpc", *args], cwd=REPO, env={**os.environ, **ROOT_OK},
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"run failed: {proc.stderr[-2000:]}")
    (path,) = root.iterdir()
    return RunDir(path)


def step_times(run_dir: RunDir) -> list[float]:
    return [e.seconds for e in run_dir.read_events() if isinstance(e, ev.Step)][1:]


def tracker_seconds(run_dir: RunDir, scratch: Path) -> float:
    """The run's step records written into fresh trackers: seconds per step."""
    records = [e for e in run_dir.read_events() if isinstance(e, ev.Step | ev.Eval)]
    trackers = Trackers(
        [TensorBoard(scratch / "tb"), WandB("gyre-bench", "offline", scratch / "wb", "b", {})]
    )
    started = time.perf_counter()
    for e in records:
        trackers.record(e)
    spent = time.perf_counter() - started
    trackers.close()
    return spent / max(sum(isinstance(e, ev.Step) for e in records), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    console = Console(width=200)
    times: dict[str, list[float]] = {"without": [], "with": []}
    direct: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for side, sets in (("without", WITHOUT), ("with", WITH)):
                console.print(f"pair {i + 1}: {side} trackers …")
                rd = run(Path(tmp) / f"{side}-{i}", args.steps, [*sets, *args.sets])
                times[side] += step_times(rd)
                if side == "with":
                    direct.append(tracker_seconds(rd, Path(tmp) / f"replay-{i}"))
    table = Table(title=f"smoke, {args.steps} steps × {args.pairs} runs a side (steps 2… counted)")
    for col in ("trackers", "steps", "mean step s", "min", "max", "vs without"):
        table.add_column(col, justify="right")
    base = mean(times["without"])
    for side, ts in times.items():
        table.add_row(side, str(len(ts)), f"{mean(ts):.2f}", f"{min(ts):.2f}", f"{max(ts):.2f}",
                      f"{mean(ts) / base:.3f}")  # fmt: skip
    console.print(table)
    per_step = mean(direct)
    console.print(
        f"the trackers' own time: {per_step * 1000:.1f} ms a step = {per_step / mean(times['with']):.2%} "
        "of a step (TensorBoard + offline W&B, the step's records written again and timed)"
    )


if __name__ == "__main__":
    main()
