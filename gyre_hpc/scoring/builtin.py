"""Built-in scorers: hidden checks and hidden tests passing, rule-based milestones, a task's own
verifier command, a question's reply against its answers, and a seeded coin for emulated runs.

Each runs the policy's code only in a scoring sandbox of its own (``scoring.session``): on a
pristine copy of the finished workspace, never the workspace itself, with the runner and its
configuration from outside the workspace, and its verdict read from a pipe the tested code
cannot reach. Files a scorer reads itself it reads from its copy, never through a link
(``sandbox.untrusted``).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from gyre_hpc.recipe.schema import ScoringConfig
from gyre_hpc.sandbox import untrusted
from gyre_hpc.scoring import checks as hidden_checks
from gyre_hpc.scoring.contract import EvaluationError, RunArtifacts, Scorer, WorkspaceFault
from gyre_hpc.scoring.pytest_run import passed, run_tests
from gyre_hpc.scoring.session import ScoringSession, bench, command
from gyre_hpc.scoring.testbench import count_tests

READ_BYTES = 64 << 20
"""The most of one file a ``file_contains`` milestone reads."""


class HiddenTestsScorer:
    """The fraction of the task's hidden checks and hidden tests that pass.

    ``task["hidden_checks"]``: calls and the values they must return (``scoring.checks``), compared
    outside the sandbox, types included: what every built-in suite uses, and what cannot be forged.
    ``task["hidden_tests"]``: a directory of pytest files, run by the test bench's pytest with a
    canary. ``task["hidden_test_count"]`` (optional): how many tests there are, so that a test file
    that cannot even be imported still counts fully.
    """

    def __init__(self, config: ScoringConfig) -> None:
        self.timeout_s, self.test_timeout_s = config.timeout_s, config.test_timeout_s
        self.copy_s = config.copy_allowance_s

    def score(self, artifacts: RunArtifacts) -> float:
        task = artifacts.task
        checks = task.get("hidden_checks") or []
        where = task.get("hidden_tests") or ""
        hidden = Path(where) if where else None  # Path("") is the current directory: never test that
        if not checks and (hidden is None or not hidden.is_dir()):
            raise EvaluationError(f"task has no hidden checks and no hidden tests directory ({where})")
        passed = total = 0
        with ScoringSession(artifacts, self.timeout_s, self.copy_s) as session:
            if checks:
                p, t = self._checks(session, checks)
                passed, total = passed + p, total + t
            if hidden is not None and hidden.is_dir():
                p, t = self._tests(session, hidden, int(task.get("hidden_test_count") or 0) - len(checks))
                passed, total = passed + p, total + t
        if total == 0:
            raise EvaluationError("no hidden tests were found")
        return passed / total

    def _checks(self, session: ScoringSession, checks: list[dict[str, str]]) -> tuple[int, int]:
        return sum(run_checks(session, checks, self.timeout_s, self.test_timeout_s)), len(checks)

    def _tests(self, session: ScoringSession, hidden: Path, count: int) -> tuple[int, int]:
        work = session.copy()
        tests = session.inputs / "tests"
        shutil.copytree(hidden, tests, symlinks=False)  # the task's own files, read-only to the bench
        phases = run_tests(session, work, [str(tests)], self.timeout_s, self.test_timeout_s)
        real = [t for t in phases if t.startswith("tests/")]
        done = sum(passed(phases, t) for t in real)
        return done, max(len(real), count_tests(hidden), count)


def run_checks(
    session: ScoringSession, checks: list[dict[str, str]], timeout_s: float, test_timeout_s: float
) -> list[bool]:
    """Whether each check's call returns its expected value, on one fresh copy (``scoring.checks``)."""
    work = session.copy()
    calls = session.input("checks.json", json.dumps([{k: c[k] for k in ("module", "call")} for c in checks]))
    limit = f"{test_timeout_s:g}"
    argv = bench("checks", "--workspace", str(work), "--checks", str(calls), "--timeout", limit)
    b = session.ready(session.run(work, argv, timeout_s))
    values: dict[int, Any] = {}
    for line in b.lines:
        i = line.get("check")
        if isinstance(i, int) and i not in values:
            values[i] = line.get("value")
    return [
        i in values and hidden_checks.same(hidden_checks.expected(c), hidden_checks.decode(values[i]))
        for i, c in enumerate(checks)
    ]


class MilestonesScorer:
    """Weighted fraction of ``task["milestones"]`` reached in the workspace's end state.

    Each milestone is ``{"weight": w, <check>}`` with one check: ``"file_exists": path``,
    ``"file_contains": [path, text]`` (read from a copy, never through a link), ``"check": {"module",
    "call", "expect"}`` (a call into the workspace's code whose value is compared outside the
    sandbox: ``scoring.checks``) or ``"command": shell`` (reached when it exits 0; each command on
    its own pristine copy, in the sandbox, so no command's side effects reach another). A command's
    exit status is its verdict: it must not be the workspace's code's own (``python3 -c 'import
    calc; …'`` is decided by whatever ``calc`` does at import; the current directory is not on
    Python's path there). To test the workspace's code use ``check``, or ``$GYRE_PYTEST TESTS…``
    (``test "$($GYRE_PYTEST t)" = 1``: every test passed).
    """

    def __init__(self, config: ScoringConfig) -> None:
        self.timeout_s, self.test_timeout_s = config.timeout_s, config.test_timeout_s
        self.copy_s = config.copy_allowance_s

    def score(self, artifacts: RunArtifacts) -> float:
        milestones = artifacts.task.get("milestones")
        if not milestones:
            raise EvaluationError("task has no milestones")
        total = reached = 0.0
        with ScoringSession(artifacts, self.timeout_s, self.copy_s) as session:
            base = session.copy()
            calls = [m["check"] for m in milestones if isinstance(m.get("check"), dict)]
            values = iter(run_checks(session, calls, self.timeout_s, self.test_timeout_s) if calls else [])
            for m in milestones:
                weight = float(m.get("weight", 1.0))
                total += weight
                reached += weight * self._reached(m, session, base, values)
        return reached / total

    def _reached(
        self, milestone: Mapping[str, Any], session: ScoringSession, base: Path, values: Iterator[bool]
    ) -> bool:
        checks: dict[str, Callable[[Any], bool]] = {
            "file_exists": lambda p: untrusted.exists(base, _rel(p)),
            "file_contains": lambda a: _contains(untrusted.read(base, _rel(a[0]), READ_BYTES), a[1]),
            "check": lambda c: isinstance(c, dict) and next(values),
            "command": lambda c: self._command_ok(c, session),
        }
        kinds = [k for k in checks if k in milestone]
        if len(kinds) != 1:
            raise EvaluationError(f"milestone {milestone} needs exactly one of {', '.join(checks)}")
        return bool(checks[kinds[0]](milestone[kinds[0]]))

    def _command_ok(self, line: str, session: ScoringSession) -> bool:
        work = session.copy()
        env = session.verdict(work, self.test_timeout_s)
        b = session.ready(session.run(work, command(line), self.timeout_s, **env))
        return b.exit_code == 0 and not b.killed


def _contains(data: bytes | None, text: str) -> bool:
    return data is not None and text in data.decode(errors="replace")


def _rel(path: str) -> str:
    """A milestone's path, which the task gives: inside the workspace, or the task is malformed."""
    if not isinstance(path, str) or not path or Path(path).is_absolute() or ".." in Path(path).parts:
        raise EvaluationError(f"milestone path {path!r} leaves the workspace")
    return path


VERIFIER_ENV = {
    # The current directory is not put first on Python's path (a workspace pytest.py would run as
    # pytest); pytest loads no conftest.py, no ini file and no plugin of the workspace's.
    "PYTHONSAFEPATH": "1",
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
}


class VerifierScorer:
    """Runs ``task["verifier"]`` (a shell command) on a copy of the workspace. When it exits 0, the
    reward is the number its last line of standard output prints, if it is one in [0, 1], else
    1.0; when it exits otherwise, 0.0 whatever it printed. What a task for a black-box harness
    brings instead of hidden tests.

    It runs as a command milestone does, with Python and pytest told not to take their runner or
    configuration from the workspace (``VERIFIER_ENV``; pytest is given our ini, which puts the
    workspace on its path, and ``--noconftest``). Tests are run by ``$GYRE_PYTEST TESTS…`` as the
    verifier's last command: it prints the fraction passed last, after every process of the tested
    code is gone (the test bench's ``verdict``); ``pytest … && echo 1`` takes its verdict from the
    tested code's own exit status, which that code can set. A verifier that runs past
    ``scoring.timeout_s`` on the policy's code scores 0.
    """

    def __init__(self, config: ScoringConfig) -> None:
        self.timeout_s, self.test_timeout_s = config.timeout_s, config.test_timeout_s
        self.copy_s = config.copy_allowance_s

    def score(self, artifacts: RunArtifacts) -> float:
        line = artifacts.task.get("verifier")
        if not line:
            raise EvaluationError("task has no verifier command")
        with ScoringSession(artifacts, self.timeout_s, self.copy_s) as session:
            work = session.copy()
            ini = session.input("pytest.ini", f"[pytest]\naddopts =\npythonpath = {work}\n")
            env = {**VERIFIER_ENV, **session.verdict(work, self.test_timeout_s)}
            env["PYTEST_ADDOPTS"] = f"-c {ini} --noconftest -p no:cacheprovider"
            b = session.ready(session.run(work, command(line, stderr=False), self.timeout_s, **env))
        if b.killed:
            raise WorkspaceFault(f"the verifier was {b.why()} on the workspace's code")
        if b.exit_code != 0:  # a last line an atexit hook of the tested code printed counts for nothing
            return 0.0
        lines = b.output.strip().splitlines()
        try:
            value = float(lines[-1]) if lines else None
        except ValueError:
            value = None
        return value if value is not None and 0.0 <= value <= 1.0 else 1.0


class ReplyScorer:
    """A question's one reply against its right answers (``task["answers"]``), word by word,
    case and punctuation aside: 1 where the reply ends with an answer ("Geese.", "The plural of
    goose is geese."); where an answer stands elsewhere in it, the answer's share of its words;
    else 0. Only the last words count in full, so listing candidates does not pay."""

    READ_CHARS = 1 << 16
    """The most of a reply read: a longer one holds the answer among too many words to score."""

    def __init__(self, config: ScoringConfig) -> None:
        del config

    def score(self, artifacts: RunArtifacts) -> float:
        said = words(artifacts.reply[: self.READ_CHARS])
        best = 0.0
        for answer in artifacts.task.get("answers") or []:
            want = words(answer)
            if not want:
                continue
            if said[-len(want) :] == want:
                return 1.0
            if any(said[i : i + len(want)] == want for i in range(len(said) - len(want) + 1)):
                best = max(best, len(want) / len(said))
        return best


def words(text: str) -> list[str]:
    """``text``'s words, lower case, without punctuation."""
    return re.findall(r"[^\W_]+(?:['-][^\W_]+)*", text.lower())


class CoinScorer:
    """Reward 1 or 0 by a coin seeded with the run id, whatever the run did.

    Only for emulated runs (benchmarks of the schedule), where no model produces an answer worth
    evaluating: the coin gives groups differing rewards, hence advantages and training work, and
    it is the same coin in every mode. The one scorer that looks at the run id and not the workspace.
    """

    def __init__(self, config: ScoringConfig) -> None:
        del config

    def score(self, artifacts: RunArtifacts) -> float:
        # Not crc32: its low bit is linear in the input, so run ids one character apart agree.
        return float(hashlib.sha256(artifacts.run_id.encode()).digest()[0] & 1)


BUILTIN: dict[str, Callable[[ScoringConfig], Scorer]] = {
    "hidden-tests": HiddenTestsScorer,
    "milestones": MilestonesScorer,
    "verifier": VerifierScorer,
    "coin": CoinScorer,
    "reply": ReplyScorer,
}
