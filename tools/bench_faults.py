#!/usr/bin/env python3
"""Servers killed at random moments: an elastic run with real SGLang cells whose servers are
SIGKILLed again and again, beside the same run without faults.

A killer waits a random time (exponential, mean ``--every`` seconds, seeded), picks one of the
run's SGLang servers at random and kills it, whatever it is doing then: serving calls, taking a
verb, loading a version, or still starting after the previous kill. The run must complete with
every step recorded once, every execution of every step finished (none lost), and one
``engine_restart`` event for each server that came back. The table sets the faulted run beside
the straight one: steps, executions, kills, restarts, wall time.

    python tools/bench_faults.py [--every 20] [--steps 3] [--seed 0] [--set tasks.group_size=2 ...]

Needs ``tools/setup.sh --sglang``; it runs ``.venv-sglang``'s Python, as the SGLang tests do.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gyre_hpc.observability import events as ev
from gyre_hpc.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "smoke-sglang.toml"
PYTHON = REPO / ".venv-sglang" / "bin" / "python"
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def servers(ports: set[str]) -> list[int]:
    """The pids of the run's SGLang servers (each listens on a port a cell said hello with): the
    leader of each server's process group (its scheduler and detokenizer share the command line)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        pid = int(proc.name)
        if b"sglang.launch_server" in b" ".join(cmd) and any(p.encode() in cmd for p in ports):
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(pid) == pid:
                    found.append(pid)
    return found


def run_dir(root: Path) -> RunDir | None:
    runs = list(root.iterdir()) if root.exists() else []
    return RunDir(runs[0]) if runs else None


def run(root: Path, steps: int, sets: list[str], every: float | None, seed: int) -> dict:
    args = [str(PYTHON), "-m", "gyre_hpc", "run", str(RECIPE), "--set", f"run.runs_dir={root}",
            "--set", f"run.steps={steps}"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    started = time.monotonic()
    proc = subprocess.Popen(args, cwd=REPO, env={**os.environ, **ROOT_OK},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    kills: list[float] = []
    done = threading.Event()

    def killer() -> None:
        rng = random.Random(seed)
        while not done.wait(rng.expovariate(1 / every)):  # type: ignore[operator]
            rd = run_dir(root)
            events = rd.read_events() if rd is not None and rd.events.exists() else []
            ports = {a.rsplit(":", 1)[1] for e in events if isinstance(e, ev.Hello) for a in e.addresses}
            if not any(isinstance(e, ev.Dispatched) for e in events):
                continue  # the world is not up yet: a kill now would test the first start only
            pids = servers(ports)
            if pids:
                victim = rng.choice(pids)
                try:
                    os.killpg(victim, signal.SIGKILL)  # the server and every process it started
                    kills.append(time.monotonic() - started)
                except ProcessLookupError:
                    pass

    thread = threading.Thread(target=killer, daemon=True)
    if every:
        thread.start()
    _, err = proc.communicate()
    done.set()
    wall = time.monotonic() - started
    rd = run_dir(root)
    events = rd.read_events() if rd is not None else []
    step_events = [e for e in events if isinstance(e, ev.Step)]
    statuses: Counter[str] = Counter()
    for s in step_events:
        statuses.update(s.statuses)
    ends = [e for e in events if isinstance(e, ev.RunEnd)]
    return {
        "exit": proc.returncode,
        "end": ends[-1].status if ends else "none",
        "steps": [s.step for s in step_events],
        "executions": [s.executions for s in step_events],
        "statuses": dict(statuses),
        "kills": len(kills),
        "restarts": [e for e in events if isinstance(e, ev.EngineRestart)],
        "wall": wall,
        "error": err[-2000:] if proc.returncode else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=20.0, help="mean seconds between kills")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="sets", action="append", default=[], help="recipe override")
    a = parser.parse_args()
    console = Console(width=200)
    results = {}
    with tempfile.TemporaryDirectory(prefix="gyre-bench-faults-") as tmp:
        for name, every in (("straight", None), (f"killed ~every {a.every:g} s", a.every)):
            with console.status(f"{name}: {a.steps} elastic steps with SGLang cells"):
                results[name] = run(Path(tmp) / name.split()[0], a.steps, a.sets, every, a.seed)
    table = Table(title="servers killed at random moments (smoke-sglang, elastic)")
    cols = ("run", "exit", "end", "steps", "executions", "statuses", "kills", "restarts (starts)",
            "restart s, mean / max", "wall s")  # fmt: skip
    for col in cols:
        table.add_column(col)
    for name, r in results.items():
        back = r["restarts"]
        starts = sum(e.attempts for e in back)
        took = [e.seconds for e in back] or [0.0]
        cells = (r["exit"], r["end"], r["steps"], r["executions"], r["statuses"], r["kills"])
        table.add_row(name, *map(str, cells), f"{len(back)} ({starts})",
                      f"{sum(took) / len(took):.1f} / {max(took):.1f}", f"{r['wall']:.0f}")  # fmt: skip
    console.print(table)
    for name, r in results.items():
        if r["error"]:
            console.print(f"[red]{name} failed:[/red] {r['error']}")


if __name__ == "__main__":
    main()
