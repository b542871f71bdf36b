"""Built-in scorers: the fraction of hidden tests passing, rule-based milestones, a task's own
verifier command, and a seeded coin for emulated runs."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gyre_hpc.recipe.schema import ScoringConfig
from gyre_hpc.scoring.contract import EvaluationError, RunArtifacts, Scorer

# The agent's code runs here: keep the evaluation's environment small and predictable.
_ENV_KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")


def _clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k in _ENV_KEEP}, **extra}


def _run(
    artifacts: RunArtifacts, command: list[str], cwd: Path, timeout_s: float, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in ``cwd`` (the workspace or its copy) in the run's sandbox; it may raise
    ``subprocess.TimeoutExpired``."""
    sandbox = artifacts.sandbox
    sandbox.prepare(cwd)
    home = {"HOME": str(cwd)} if sandbox.confined else {}  # the host's HOME is not inside
    launch = sandbox.launch(cwd, command, _clean_env(**env, **home))
    return subprocess.run(launch.argv, **launch.popen(), capture_output=True, text=True, timeout=timeout_s)


class HiddenTestsScorer:
    """Copies the workspace and the task's hidden tests aside, runs pytest, returns passed/total.

    ``task["hidden_tests"]``: a directory of test files. ``task["hidden_test_count"]`` (optional):
    the number of tests, so that a test file that cannot even be imported still counts fully.
    """

    def __init__(self, config: ScoringConfig) -> None:
        self.timeout_s = config.timeout_s

    def score(self, artifacts: RunArtifacts) -> float:
        where = artifacts.task.get("hidden_tests") or ""
        hidden = Path(where)
        if not where or not hidden.is_dir():  # Path("") is the current directory: never test that
            raise EvaluationError(f"task has no hidden tests directory ({hidden})")
        with tempfile.TemporaryDirectory(prefix="gyre-score-") as tmp:
            work = Path(tmp) / "workspace"
            shutil.copytree(artifacts.workspace, work, symlinks=True)
            shutil.copytree(hidden, work / "_hidden_tests")
            report = work / ".gyre-report.xml"  # the sandbox writes only its workspace
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--continue-on-collection-errors",
                f"--junitxml={report.name}",
                "_hidden_tests",
            ]
            try:
                proc = _run(
                    artifacts, cmd, work, self.timeout_s, PYTHONPATH=str(work), PYTHONDONTWRITEBYTECODE="1"
                )
            except subprocess.TimeoutExpired:
                raise EvaluationError(f"hidden tests ran over {self.timeout_s:g} s") from None
            if proc.returncode not in (0, 1) or not report.exists():
                raise EvaluationError(
                    f"pytest exited {proc.returncode}: {proc.stdout[-300:]}{proc.stderr[-300:]}"
                )
            passed, total = _junit_counts(report)
        total = max(total, int(artifacts.task.get("hidden_test_count", 0)))
        if total == 0:
            raise EvaluationError("no hidden tests were collected")
        return passed / total


def _junit_counts(report: Path) -> tuple[int, int]:
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) + int(s.get("skipped", 0)) for s in suites)
    return total - bad, total


class MilestonesScorer:
    """Weighted fraction of ``task["milestones"]`` reached in the workspace's end state.

    Each milestone is ``{"weight": w, <check>}`` with one check: ``"file_exists": path``,
    ``"file_contains": [path, text]`` or ``"command": shell`` (reached when it exits 0).
    """

    def __init__(self, config: ScoringConfig) -> None:
        self.timeout_s = config.timeout_s

    def score(self, artifacts: RunArtifacts) -> float:
        milestones = artifacts.task.get("milestones")
        if not milestones:
            raise EvaluationError("task has no milestones")
        total = reached = 0.0
        for m in milestones:
            weight = float(m.get("weight", 1.0))
            total += weight
            reached += weight * self._reached(m, artifacts)
        return reached / total

    def _reached(self, milestone: Mapping[str, Any], artifacts: RunArtifacts) -> bool:
        ws = artifacts.workspace
        checks: dict[str, Callable[[Any], bool]] = {
            "file_exists": lambda p: _inside(ws, p).exists(),
            "file_contains": lambda a: (
                _inside(ws, a[0]).is_file() and a[1] in _inside(ws, a[0]).read_text(errors="replace")
            ),
            "command": lambda c: self._command_ok(c, artifacts),
        }
        kinds = [k for k in checks if k in milestone]
        if len(kinds) != 1:
            raise EvaluationError(f"milestone {milestone} needs exactly one of {', '.join(checks)}")
        return bool(checks[kinds[0]](milestone[kinds[0]]))

    def _command_ok(self, command: str, artifacts: RunArtifacts) -> bool:
        ws = artifacts.workspace
        try:
            return _run(artifacts, ["bash", "-c", command], ws, self.timeout_s).returncode == 0
        except subprocess.TimeoutExpired:
            return False


class VerifierScorer:
    """Runs ``task["verifier"]`` (a shell command) in a copy of the workspace: the reward is the
    number its last line of output prints, if it is one in [0, 1]; else 1.0 when it exits 0,
    0.0 otherwise. What a task for a black-box harness brings instead of hidden tests."""

    def __init__(self, config: ScoringConfig) -> None:
        self.timeout_s = config.timeout_s

    def score(self, artifacts: RunArtifacts) -> float:
        command = artifacts.task.get("verifier")
        if not command:
            raise EvaluationError("task has no verifier command")
        with tempfile.TemporaryDirectory(prefix="gyre-score-") as tmp:
            work = Path(tmp) / "workspace"
            shutil.copytree(artifacts.workspace, work, symlinks=True)
            try:
                proc = _run(artifacts, ["bash", "-c", command], work, self.timeout_s)
            except subprocess.TimeoutExpired:
                raise EvaluationError(f"verifier timed out after {self.timeout_s:g} s") from None
        lines = proc.stdout.strip().splitlines()
        try:
            value = float(lines[-1]) if lines else None
        except ValueError:
            value = None
        if value is not None and 0.0 <= value <= 1.0:
            return value
        return 1.0 if proc.returncode == 0 else 0.0


def _inside(ws: Path, rel: str) -> Path:
    path = (ws / rel).resolve()
    if not path.is_relative_to(ws.resolve()):
        raise EvaluationError(f"milestone path {rel!r} leaves the workspace")
    return path


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
}
