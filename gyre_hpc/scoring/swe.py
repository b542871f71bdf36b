"""SWE-bench's scoring rule, run as the hidden tests are (``scoring.session``, the test bench).

```
 scorer copy of the workspace ─▶ its .git goes (the agent's repository config runs nothing here)
   every conftest.py ─▶ the base commit's (an added one goes)
   every file the test patch touches ─▶ as the patch leaves it at the base
 test bench pytest: FAIL_TO_PASS + PASS_TO_PASS node ids, and a canary that must fail
 any PASS_TO_PASS not passed ─▶ 0 (a regression); else passed FAIL_TO_PASS / FAIL_TO_PASS
```

The restored files come from the task (``tasks.swe_repo.for_scorer``), written into the fresh copy
before anything of the workspace runs, never through a link it holds. An attempt that changes
nothing scores 0: its FAIL_TO_PASS tests fail.
"""

from __future__ import annotations

from gyre_hpc.recipe.schema import ScoringConfig
from gyre_hpc.sandbox import untrusted
from gyre_hpc.scoring.contract import EvaluationError, RunArtifacts, WorkspaceFault
from gyre_hpc.scoring.pytest_run import passed, run_tests
from gyre_hpc.scoring.session import ScoringSession


class SweScorer:
    def __init__(self, config: ScoringConfig) -> None:
        self.timeout_s, self.test_timeout_s = config.timeout_s, config.test_timeout_s
        self.copy_s = config.copy_allowance_s

    def score(self, artifacts: RunArtifacts) -> float:
        parts = artifacts.task.get("swe")
        if not parts:
            raise EvaluationError("task is not a SWE instance (no swe parts)")
        f2p, p2p = list(parts["fail_to_pass"]), list(parts["pass_to_pass"])
        with ScoringSession(artifacts, self.timeout_s, self.copy_s) as session:
            work = session.copy()
            owner = session.sandbox.owner_in(session.group)
            untrusted.remove(work / ".git")
            for e in list(untrusted.walk(work)):
                if e.rel.rsplit("/", 1)[-1] == "conftest.py":
                    untrusted.place(work, e.rel, None)
            for rel, text in {**parts["conftests"], **parts["tests"]}.items():
                untrusted.place(work, rel, None if text is None else text.encode(), owner)
            phases = run_tests(session, work, [*f2p, *p2p], self.timeout_s, self.test_timeout_s, rootdir=work)
        if broken := [t for t in p2p if not passed(phases, t)]:
            raise WorkspaceFault(f"{len(broken)} of {len(p2p)} PASS_TO_PASS tests fail, {broken[0]} first")
        return sum(passed(phases, t) for t in f2p) / len(f2p)
