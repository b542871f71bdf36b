#!/usr/bin/env python3
"""Elastic vs async vs colocate: the same recipe, cells and seed, run one after another.

    python tools/bench_modes.py [RECIPE] [--steps 4] [--cells 3] [--set section.key=value ...]

Each mode runs the real system (``gyre-hpc run``) on the same workload; the table reports the
mean step time (step 1, which includes warm-up, is left out), sampling time, how early training
started in elastic steps, and the step-time ratio of elastic against each baseline. On a
laptop-class machine every cell shares the same few cores, so sampling and training contend for
compute and the ratio understates what separate GPUs would show.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

from rich.console import Console
from rich.table import Table

from gyre_hpc.observability.events import read_events

MODES = ("elastic", "async", "colocate")


def run_mode(recipe: str, mode: str, steps: int, cells: int, sets: list[str], root: Path) -> Path:
    args = ["run", recipe, "--set", f"scheduler.mode={mode}", "--set", f"run.steps={steps}"]
    args += [
        "--set",
        f"cells.count={cells}",
        "--set",
        "tasks.eval_every=0",
        "--set",
        f"run.runs_dir={root / mode}",
    ]
    args += ["--set", "trainer.checkpoint_every=0"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run([sys.executable, "-m", "gyre_hpc", *args], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{mode}: gyre-hpc run failed:\n{proc.stderr[-2000:]}")
    return next((root / mode).iterdir())


def summarize(run_dir: Path) -> dict[str, float]:
    steps = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "step"][1:]
    early = [e.get("train_before_burst_end_s") or 0.0 for e in steps]
    return {
        "step_s": mean(e["seconds"] for e in steps),
        "sample_s": mean(e["sample_seconds"] for e in steps),
        "reward": mean(e["reward_mean"] for e in steps),
        "early_s": mean(early),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", nargs="?", default="recipes/smoke.toml")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cells", type=int, default=3)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for mode in MODES:
            console.print(f"running {mode} …")
            results[mode] = summarize(
                run_mode(args.recipe, mode, args.steps, args.cells, args.sets, Path(tmp))
            )
    table = Table(title=f"{args.recipe}, {args.cells} cells, steps 2–{args.steps} (same seed)")
    for col in ("mode", "step s", "sampling s", "training began before burst end (s)", "reward"):
        table.add_column(col, justify="right")
    for mode, r in results.items():
        table.add_row(
            mode, f"{r['step_s']:.2f}", f"{r['sample_s']:.2f}", f"{r['early_s']:.2f}", f"{r['reward']:.3f}"
        )
    console.print(table)
    e = results["elastic"]["step_s"]
    console.print(
        f"step-time speed-up of elastic: {results['async']['step_s'] / e:.2f}× vs async, "
        f"{results['colocate']['step_s'] / e:.2f}× vs colocate"
    )


if __name__ == "__main__":
    main()
