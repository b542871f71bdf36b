#!/usr/bin/env python3
"""The controller's CPU per 1,000 model calls and per 1,000 tool commands, with the executions on
the controller's node and on executor nodes.

Runs the same seeded recipe (default: the smoke recipe, its tasks and sandbox) with
``executors.nodes = 0`` and with ``executors.nodes = N`` (local executor processes, the code
an executor node runs), alternating, ``--repeat`` times each. Each step event carries the CPU
seconds the controller's process spent in the step (``controller_cpu_s``: its threads and the
processes it reaped, i.e. sandboxed commands and scorers when they run on its node), and the
step's model calls and tool calls; the table divides the one by the others over every step.

    python tools/bench_executors.py [--recipe recipes/smoke.toml] [--steps 2] [--executors 2]
        [--repeat 1] [--set KEY=VALUE ...] [--json]

Both figures come from the same runs: a smoke execution makes about one tool call per model
call, so the two columns split one CPU total two ways. On this 2-core machine the executors
share the controller's cores, so step times say nothing about a cluster; the controller's CPU
does, since that is what a controller node must have for a given load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gyre_hpc.observability.events import Step, read_events

REPO = Path(__file__).resolve().parents[1]


def one_run(recipe: str, steps: int, executors: int, sets: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-executors-") as runs:
        args = [sys.executable, "-m", "gyre_hpc", "run", recipe]
        for s in [f"run.runs_dir={runs}", f"run.steps={steps}", "tasks.eval_every=0", *sets]:
            args += ["--set", s]
        args += ["--set", f"executors.nodes={executors}"]
        proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
        if proc.returncode:
            raise SystemExit(
                f"run failed ({executors} executors): {proc.stdout[-1500:]}{proc.stderr[-1500:]}"
            )
        (run_dir,) = Path(runs).iterdir()
        events = [e for e in read_events(run_dir / "events.jsonl") if isinstance(e, Step)]
    return {
        "steps": len(events),
        "calls": sum(e.calls for e in events),
        "tool_calls": sum(e.tool_calls for e in events),
        "cpu_s": sum(e.controller_cpu_s for e in events),
        "step_s": sum(e.seconds for e in events) / max(len(events), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "smoke.toml"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    totals: dict[int, dict[str, float]] = {}
    for _ in range(args.repeat):
        for n in (0, args.executors):  # alternating: both see the same machine
            got = one_run(args.recipe, args.steps, n, args.sets)
            into = totals.setdefault(n, dict.fromkeys(got, 0.0))
            for k, v in got.items():
                into[k] += v / args.repeat
    rows = {
        ("controller" if n == 0 else f"{n} executor processes"): {
            **t,
            "cpu_s_per_1k_calls": 1000 * t["cpu_s"] / max(t["calls"], 1),
            "cpu_s_per_1k_tool_calls": 1000 * t["cpu_s"] / max(t["tool_calls"], 1),
        }
        for n, t in totals.items()
    }
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title=f"controller CPU ({args.steps} steps × {args.repeat}, {Path(args.recipe).name})")
    for col in (
        "executions run on",
        "calls",
        "tool calls",
        "controller CPU s",
        "s / 1k calls",
        "s / 1k tool calls",
        "step s",
    ):
        table.add_column(col, justify="right")
    for where, r in rows.items():
        table.add_row(
            where,
            f"{r['calls']:.0f}",
            f"{r['tool_calls']:.0f}",
            f"{r['cpu_s']:.1f}",
            f"{r['cpu_s_per_1k_calls']:.1f}",
            f"{r['cpu_s_per_1k_tool_calls']:.1f}",
            f"{r['step_s']:.1f}",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
