#!/usr/bin/env python3
"""What scoring one execution costs, per built-in scorer, on an honest workspace.

Each row scores ``N`` finished executions of one built-in suite's task, solved correctly,
exactly as the dispatcher does (``ScoringRunners`` → ``RunArtifacts`` with the run's sandbox),
and reports the wall time per execution:

- ``milestones (smoke)``: the smoke suite's task (a file check and one command milestone);
- ``milestones (terminal-mini)``: five milestones, two of them commands;
- ``hidden-tests (repo-mini)``: a package of two to six functions and its hidden tests (checks);
- ``hidden-tests (pytest files)``: the same task with its checks written as pytest files, as a
  JSONL suite brings them;
- ``verifier``: ``examples/verifier-tasks.jsonl``'s ``greet`` (a script the verifier runs).

    python tools/bench_scoring.py [--n 20] [--sandbox bwrap|none]

The rows run interleaved, so each sees the same machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gyre_hpc.recipe.schema import AgentConfig, ScoringConfig
from gyre_hpc.sandbox.confine import Sandbox
from gyre_hpc.scoring import RunArtifacts, ScoringRunners
from gyre_hpc.tasks.jsonl import load_jsonl
from gyre_hpc.tasks.suites import FUNCTIONS, load_suite
from gyre_hpc.tasks.task import Task

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = {
    "add": "return a + b", "sub": "return a - b", "mul": "return a * b",
    "clamp": "return max(lo, min(x, hi))",
    "is_prime": "return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
    "fib": "a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "factorial": "import math\n    return math.factorial(n)",
    "gcd": "import math\n    return math.gcd(a, b)",
    "reverse_words": "return ' '.join(reversed(s.split()))",
    "count_vowels": "return sum(c in 'aeiouAEIOU' for c in s)",
    "is_palindrome": "return s.lower() == s.lower()[::-1]",
    "flatten": "return [x for xs_ in xs for x in xs_]",
    "chunk": "return [xs[i:i + n] for i in range(0, len(xs), n)]",
    "dedupe": "return list(dict.fromkeys(xs))",
    "mean": "return sum(xs) / len(xs)",
    "word_count": "out = {}\n    for w in s.split():\n        out[w] = out.get(w, 0) + 1\n    return out",
    "caesar": "return ''.join(chr((ord(c) - 97 + k) % 26 + 97) if c.islower() else c for c in s)",
    "to_snake": "import re\n    return re.sub(r'(?<!^)([A-Z])', r'_\\1', s).lower()",
    "running_sum": "out, t = [], 0\n    for x in xs:\n        t += x\n        out.append(t)\n    return out",
    "maximum": "m = xs[0]\n    for x in xs:\n        if x > m:\n            m = x\n    return m",
}  # fmt: skip
"""A correct body for every function ``repo-mini`` asks for."""


def solve_repo_mini(task: Task, ws: Path) -> None:
    """Write the package ``task.spec`` asks for, every function correct."""
    params = {name: p for name, p, _, _ in FUNCTIONS}
    package = task.spec.split("`")[1]
    (ws / package).mkdir(parents=True)
    (ws / package / "__init__.py").write_text("")
    for line in task.spec.splitlines():
        if not line.startswith(f"- {package}/"):
            continue
        module, _, rest = line[2:].partition(": ")
        names = [item.strip().split("(")[0] for item in rest.split(";")]
        body = "".join(f"def {n}({params[n]}):\n    {SOLUTIONS[n]}\n\n\n" for n in names)
        (ws / module).write_text(body)


def solve_terminal_mini(task: Task, ws: Path) -> None:
    d = task.milestones[0]["file_exists"].split("/")[0]
    port = task.milestones[1]["file_contains"][1]
    word = task.milestones[3]["command"].rsplit(" ", 1)[1]
    (ws / d / "config").mkdir(parents=True)
    (ws / d / "logs").mkdir()
    (ws / d / "config" / "app.ini").write_text(f"{port}\n")
    (ws / d / "run.sh").write_text(f"echo {word}\n")
    (ws / d / "run.sh").chmod(0o755)
    (ws / d / "logs" / "count.txt").write_text("1\n")


def as_pytest(task: Task) -> Task:
    """``task`` with pytest files for hidden tests: one test per check (or per old assertion)."""
    cases = [(c["module"], c["call"], c["expect"]) for c in getattr(task, "hidden_checks", [])]
    if not cases:  # a version of repo-mini that still shipped pytest files
        return task
    tests = {
        "test_hidden.py": "".join(
            f"def test_{i}():\n    from {m} import {call.split('(')[0]}\n    assert {call} == {expect}\n\n"
            for i, (m, call, expect) in enumerate(cases)
        )
    }
    return Task(id=task.id + "-pytest", spec=task.spec, scorer="hidden-tests", hidden_tests=tests,
                hidden_test_count=len(cases))  # fmt: skip


def cases() -> dict[str, tuple[Task, Callable[[Task, Path], None]]]:
    smoke = load_suite("smoke", 1, seed=0)[0]
    repo = load_suite("repo-mini", 1, seed=0)[0]
    greet = next(t for t in load_jsonl(REPO / "examples" / "verifier-tasks.jsonl") if t.id == "greet")
    return {
        "milestones (smoke)": (smoke, lambda t, ws: (ws / "answer.txt").write_text("done\n")),
        "milestones (terminal-mini)": (load_suite("terminal-mini", 1, seed=0)[0], solve_terminal_mini),
        "hidden-tests (repo-mini)": (repo, solve_repo_mini),
        "hidden-tests (pytest files)": (as_pytest(repo), solve_repo_mini),
        "verifier (greet)": (greet, lambda t, ws: (ws / "hello.sh").write_text("echo hello\n")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="executions scored per row")
    ap.add_argument("--sandbox", default="bwrap", choices=["bwrap", "none"])
    args = ap.parse_args()
    box = Sandbox.from_config(AgentConfig(sandbox=args.sandbox), (), print)
    runners = ScoringRunners(ScoringConfig(max_retries=0))
    times: dict[str, list[float]] = {name: [] for name in cases()}
    rewards: dict[str, set[float | None]] = {name: set() for name in cases()}
    with tempfile.TemporaryDirectory(prefix="gyre-bench-scoring-") as tmp:
        os.chmod(tmp, 0o755)
        root = Path(tmp)
        for i in range(args.n):
            for name, (task, solve) in cases().items():
                ws = root / f"{i}-{''.join(c if c.isalnum() else '-' for c in name)}"
                task.materialize(ws)
                solve(task, ws)
                box.prepare(ws)
                artifacts = RunArtifacts(f"r{i}", ws, "finished", task.for_scorer(root / "tasks"), box)
                started = time.perf_counter()
                result = runners.get(task.scorer).score(artifacts)
                times[name].append(time.perf_counter() - started)
                rewards[name].add(result.reward)
    table = Table(title=f"scoring one honest execution ({args.n} each, sandbox {box.kind})")
    for col in ("scorer (suite)", "reward", "p50 ms", "mean ms", "max ms"):
        table.add_column(col, justify="left" if col.startswith("scorer") else "right")
    for name, ts in times.items():
        ms = [t * 1000 for t in ts]
        shown = ", ".join(f"{r:.2f}" if r is not None else "dropped" for r in sorted(rewards[name], key=str))
        table.add_row(
            name, shown, f"{statistics.median(ms):.1f}", f"{statistics.mean(ms):.1f}", f"{max(ms):.1f}"
        )
    Console().print(table)


if __name__ == "__main__":
    main()
