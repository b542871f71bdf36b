#!/usr/bin/env python3
"""Runs of one recipe side by side — held-out curves, training reward and off-policy share —
from their run directories' events, into one PNG.

    python tools/plot_learning.py elastic=runs/a "max_staleness 1=runs/b" --out learning.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gyre_hpc.observability.plot import plot_runs
from gyre_hpc.rundir import RunDir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    parser.add_argument("--out", type=Path, default=Path("learning.png"))
    parser.add_argument("--title", default="held-out and training curves, same seed")
    args = parser.parse_args()
    runs = {}
    for item in args.runs:
        label, sep, where = item.partition("=")
        if not sep or not (Path(where) / "events.jsonl").exists():
            raise SystemExit(f"error: {item}: expected LABEL=RUN_DIR, a directory with events.jsonl")
        runs[label] = RunDir(Path(where)).read_events()
    print(plot_runs(runs, args.out, args.title))


if __name__ == "__main__":
    main()
