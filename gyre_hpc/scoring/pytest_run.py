"""Tests run by the test bench's pytest, with a canary: each test's phases as the bench reported
them, or the workspace's fault.

```
 tests (paths or node ids) + canary/test_<nonce>.py (must fail) + our pytest.ini
   ─▶ testbench.py pytest in a fresh sandbox ─▶ report pipe: one line per phase of each test
   canary missing or unfinished ─▶ WorkspaceFault (the run was cut short)
   canary passed               ─▶ WorkspaceFault (the runner's results were changed)
```

What it does not know: which tests must pass, or what a pass is worth — the scorer decides.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from gyre_hpc.scoring.contract import WorkspaceFault
from gyre_hpc.scoring.session import ScoringSession, bench

Phases = dict[str, dict[str, str]]
"""Test id → phase (``setup``, ``call``, ``teardown``) → outcome, the first report of each."""


def run_tests(
    session: ScoringSession,
    work: Path,
    tests: list[str],
    timeout_s: float,
    test_timeout_s: float,
    rootdir: Path | None = None,
) -> Phases:
    """Run ``tests`` on the workspace copy ``work``; the phases of every test but the canary."""
    nonce = secrets.token_hex(8)
    canary = session.input(f"canary/test_{nonce}.py", f"def test_{nonce}():\n    assert False, 'must fail'\n")
    ini = session.input("pytest.ini", "[pytest]\naddopts =\n")
    where = ["--rootdir", str(rootdir)] if rootdir is not None else []
    argv = bench(
        "pytest", "--workspace", str(work), "--tests", *tests, str(canary), "--ini", str(ini), *where,
        "--canary", nonce, "--timeout", f"{test_timeout_s:g}",
    )  # fmt: skip
    b = session.ready(session.run(work, argv, timeout_s, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"))
    phases: Phases = {}
    for line in b.lines:
        test, when, outcome = line.get("test"), line.get("when"), line.get("outcome")
        if isinstance(test, str) and isinstance(when, str) and isinstance(outcome, str):
            phases.setdefault(test, {}).setdefault(when, outcome)
    mine = [t for t in phases if nonce in t]
    if not mine or "call" not in phases[mine[0]]:
        raise WorkspaceFault(f"the tests did not run to the end ({b.why()})")
    if phases[mine[0]]["call"] == "passed":
        raise WorkspaceFault("a test that must fail passed: the test runner's results were changed")
    return {t: p for t, p in phases.items() if nonce not in t}


def passed(phases: Phases, test: str) -> bool:
    """The test ran and every phase of it passed."""
    p = phases.get(test, {})
    return p.get("call") == "passed" and all(o == "passed" for o in p.values())
