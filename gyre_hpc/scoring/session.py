"""One scorer run: pristine copies of the workspace, a fresh sandbox per command, the verdict
over a pipe the tested code cannot reach.

```
 workspace (the policy's) ─untrusted.copy_tree─▶ scratch/work-N   (read-write; one per command;
                                                  its configuration made inert: scoring.inert)
 hidden tests, checks, ini, canary ────────────▶ scratch/inputs   (read-only)
 the test bench, or a command under `ready`   ─▶ a fresh sandbox in the scorer's limits group
                                                  └─ report pipe ─▶ Bench: ready? what it said
```

The fault rule every built-in scorer follows: before the bench says ``ready`` nothing of the
workspace has run, so a failure then (no sandbox, no interpreter, a missing pytest) is the
scorer's: ``EvaluationError``, retried, then dropped with the reason. Once it is ready only the
policy's code can change what happens: a crash, a hang past the time limit, a flood, a report
that stops — all are the workspace's, and score what was earned (``WorkspaceFault`` is a 0).

A command's readiness is said by ``bash`` itself before it runs the command (``READY``), and the
report pipe is closed before the command starts: the command's exit status, which bwrap hands
back, is the result. The test bench closes its pipe to what it starts as well.

This module knows nothing of what a scorer checks: it copies, runs and listens.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from gyre_hpc.sandbox import supervise, untrusted
from gyre_hpc.sandbox.limits import Group
from gyre_hpc.sandbox.spec import Mount
from gyre_hpc.scoring import inert
from gyre_hpc.scoring.contract import EvaluationError, RunArtifacts, WorkspaceFault

TESTBENCH = Path(__file__).with_name("testbench.py")
REPORT = "{report}"
"""Where an argv names the report pipe's fd."""
READY = 'r=$1; c=$2; shift 2; printf \'{"ready":true}\\n\' >&"$r"; exec {r}>&-; unset r; eval "$c"'
"""A command's start: say ready on the report pipe, close it, run the command (in the same bash)."""
QUIET = READY.replace("exec {r}>&-;", "exec {r}>&- 2>/dev/null;")
"""The same, its standard error discarded (a verifier's reward is its standard output's last line)."""
ENV_KEEP = ("PATH", "LANG", "LC_ALL")
KEEP_OUTPUT = 4096


@dataclass(frozen=True)
class Bench:
    """What one run in the scoring sandbox left."""

    ready: bool
    lines: list[dict]
    """The report's JSON objects after ``ready``, in order (malformed lines skipped)."""
    exit_code: int
    killed: str
    """Why it was killed ("" when it ended by itself): the time limit, the quota, its output."""
    output: str
    """What was kept of its stdout and stderr (for reasons)."""

    def why(self) -> str:
        if self.killed:
            return f"killed: {self.killed}"
        tail = self.output.strip().splitlines()[-1:] or [""]
        return f"exit code {self.exit_code}" + (f": {tail[0][:200]}" if tail[0] else "")


def command(line: str, stderr: bool = True) -> list[str]:
    """The argv that runs the shell ``line`` after saying ready (its stderr discarded if not ``stderr``)."""
    return ["bash", "-c", READY if stderr else QUIET, "gyre-ready", REPORT, line]


def bench(mode: str, *args: str) -> list[str]:
    """The argv of the test bench in ``mode`` (checks, pytest)."""
    return [sys.executable, "-I", "-B", str(TESTBENCH), mode, "--report", REPORT, *args]


class ScoringSession:
    """A scratch directory, the scorer's limits group, and its sandbox: copies, inputs, runs.

    Its time is bounded: its runs together within ``run_s`` (``scoring.timeout_s``), its copies
    together within ``copy_s`` (``scoring.copy_allowance_s``); past either, the workspace's size or
    code made it so: ``WorkspaceFault``."""

    def __init__(self, artifacts: RunArtifacts, run_s: float = math.inf, copy_s: float = math.inf) -> None:
        self.artifacts = artifacts
        self.runs = 0
        self.run_left, self.copy_left = run_s, copy_s

    def __enter__(self) -> ScoringSession:
        self.dir = Path(tempfile.mkdtemp(prefix="gyre-score-"))
        self.dir.chmod(0o755)  # the sandbox's uid traverses it to its copy
        self.inputs = self.dir / "inputs"
        self.inputs.mkdir(mode=0o755)
        self.home = inert.home(self.dir)
        sandbox = self.artifacts.sandbox
        self.sandbox = sandbox.showing([self.inputs, self.home, TESTBENCH]) if sandbox.confined else sandbox
        task = self.artifacts.task  # where the task's tests look, in its image
        self.sandbox = self.sandbox.at(task.get("workdir"), image=task.get("image") or "")
        self.group: Group = self.sandbox.groups.open(f"score-{self.artifacts.run_id}")
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.group.close()
        untrusted.remove(self.dir)

    def copy(self) -> Path:
        """A pristine copy of the workspace (bounded by the workspace's quota), for one command."""
        self.runs += 1
        work = self.dir / f"work-{self.runs}"
        limits = self.sandbox.limits
        owner = self.sandbox.owner_in(self.group)
        started = time.monotonic()
        try:
            untrusted.copy_tree(
                self.artifacts.workspace, work, limits.workspace_entries, limits.workspace_bytes, owner,
                deadline=started + self.copy_left,
            )  # fmt: skip
        except untrusted.OutOfTime as err:
            raise WorkspaceFault(
                f"copying the workspace for scoring ran past scoring.copy_allowance_s ({err})"
            ) from None
        finally:
            self.copy_left -= time.monotonic() - started
        inert.scrub(work, owner)  # data, not configuration
        return work

    def place(self, *mounts: Mount) -> None:
        """Show ``mounts`` (directories of this session's) to the runs after this."""
        self.sandbox = self.sandbox.at(None, mounts)

    def input(self, rel: str, content: str) -> Path:
        """A read-only file the sandbox is shown (checks, an ini file, a canary test)."""
        path = self.inputs / rel
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        path.write_text(content)
        path.chmod(0o644)
        return path

    def verdict(self, work: Path, test_timeout_s: float) -> dict[str, str]:
        """``GYRE_PYTEST``: the command a verifier or a milestone runs tests on ``work`` with, whose
        verdict the tested code can neither forge nor outlive (the test bench's ``verdict``)."""
        nonce = secrets.token_hex(8)
        must_fail = f"def test_{nonce}():\n    assert False, 'must fail'\n"
        canary = self.input(f"verdict/test_{nonce}.py", must_fail)
        ini = self.input("verdict/pytest.ini", "[pytest]\naddopts =\n")
        python = "python3" if self.sandbox.rooted is not None else sys.executable
        script = self.input("verdict/gyre-pytest", "#!/bin/sh\n" + shlex.join([
            python, "-I", "-B", str(TESTBENCH), "verdict", "--workspace", str(work), "--ini", str(ini),
            "--canary", nonce, "--canary-file", str(canary), "--timeout", f"{test_timeout_s:g}", "--tests",
        ]) + ' "$@"\n')  # fmt: skip
        script.chmod(0o755)
        return {"GYRE_PYTEST": str(script)}

    def run(self, work: Path, argv: list[str], timeout_s: float, **env: str) -> Bench:
        """``argv`` in a fresh sandbox on ``work``; its report, what it printed, how it ended.
        It gets ``timeout_s`` or what is left of the session's run time, whichever is less."""
        late = WorkspaceFault("scoring ran past scoring.timeout_s on the workspace's code")
        if self.run_left <= 0:
            raise late
        capped = self.run_left < timeout_s
        started = time.monotonic()
        try:
            b = self._run(work, argv, min(timeout_s, self.run_left), env)
        finally:
            self.run_left -= time.monotonic() - started
        if capped and b.killed and not b.ready:  # the earlier runs took the time: not the scorer's failure
            raise late
        return b

    def _run(self, work: Path, argv: list[str], timeout_s: float, env: dict[str, str]) -> Bench:
        base = {k: v for k, v in os.environ.items() if k in ENV_KEEP}
        env = {**base, **inert.environment(self.home, work), "PYTHONDONTWRITEBYTECODE": "1", **env}
        read, write = supervise.report_pipe()
        argv = [a.replace(REPORT, str(write)) for a in argv]
        if self.sandbox.rooted is not None and argv[0] == sys.executable:
            argv[0] = "python3"  # the bench runs on the image's Python, beside the tested code's packages
        try:
            launch = self.sandbox.launch(work, argv, env, group=self.group, cpu_s=int(timeout_s) + 1)
            limits = self.sandbox.limits
            done = supervise.run(
                launch.argv, launch.popen(), group=self.group, timeout_s=timeout_s,
                keep_bytes=KEEP_OUTPUT, report=(read, write),
                quota=supervise.Quota(work, limits.workspace_entries, limits.workspace_bytes),
            )  # fmt: skip
        except OSError as err:
            raise EvaluationError(f"the scorer's sandbox did not start: {err.strerror or err}") from None
        finally:
            self.group.kill()  # what it left running goes before the next command
        lines = _lines(done.report)
        ready = bool(lines) and lines[0].get("ready") is True
        return Bench(ready, lines[1:] if ready else [], done.exit_code, done.killed,
                     done.output.decode(errors="replace"))  # fmt: skip

    def ready(self, b: Bench) -> Bench:
        """``b`` if the bench got as far as ready, else the scorer's failure (retried)."""
        if not b.ready:
            raise EvaluationError(f"the scorer's sandbox did not get ready ({b.why()})")
        return b


def _lines(report: bytes) -> list[dict]:
    out = []
    for raw in report.splitlines():
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out
