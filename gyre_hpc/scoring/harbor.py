"""Harbor's scoring rule: ``tests/test.sh`` runs on a copy of the finished workspace and writes
the reward to ``/logs/verifier/reward.txt`` (a number) or ``reward.json`` (``{"reward": x, …}``).

```
 scorer copy of the workspace ─▶ /app (the task's workdir), read-write
 the task's tests/  ─▶ /tests, read-only          a fresh directory ─▶ /logs/verifier
 bash /tests/test.sh ── in the run's sandbox, within the time limit ──▶ every process killed
 test.sh exited non-zero ─▶ 0 (a reward write the tested code made fail fails test.sh)
 the runtime reads logs/reward.json and reward.txt: regular files (no link, no FIFO), at most
 64 KiB, one finite number in [0, 1], the same in both if both are there; anything else: 0
```

The log directory exists only for this run of the tests, so nothing the agent left in its
workspace, and nothing it started (its processes are gone before scoring), writes there first.
Where the runtime is root and the sandbox is bwrap, the reward files are guarded: the directory is
root's and sticky, ``reward.json`` and ``reward.txt`` are root's, made empty before the tests run
(empty is absent), and a fanotify permission event on their inodes lets only test.sh's shell (the
sandbox's pid 2) or a process that shell started itself open them; a daemon the tested code left,
a hard link, a rename over them are refused, and the refusals are named in the reason.
What the guard cannot tell apart: test.sh's shell and a command it runs writing the reward for the
tested code (``python3 app.py > reward.txt``). A ``test.sh`` is safe when it follows the pattern of
``examples/harbor/fix-wordcount``: each check runs the tested code in a process of its own with
its output to a file of the check's own, stops and kills every process but the shell's ancestors,
and only then compares that output in the shell; the reward is its last command. Without root
or bwrap nothing is guarded: that pattern is then what holds (a read-only ``reward.txt`` the
tested code made first fails the last write, and so test.sh: a 0). A ``test.sh`` that derives its
reward from a file the tested code can write (pytest's ``junit.xml``) or from pytest's exit status
is only as safe as the tested code lets it be.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import replace
from pathlib import Path

from gyre_hpc.recipe.schema import ScoringConfig
from gyre_hpc.sandbox import untrusted
from gyre_hpc.sandbox.open_guard import OpenGuard, ns_pid, parent
from gyre_hpc.sandbox.spec import Mount
from gyre_hpc.scoring.builtin import VERIFIER_ENV
from gyre_hpc.scoring.contract import EvaluationError, RunArtifacts, WorkspaceFault
from gyre_hpc.scoring.session import ScoringSession, command

TESTS, LOGS = "/tests", "/logs/verifier"
REWARD_BYTES = 64 << 10


class HarborScorer:
    def __init__(self, config: ScoringConfig) -> None:
        self.timeout_s, self.copy_s = config.timeout_s, config.copy_allowance_s

    def score(self, artifacts: RunArtifacts) -> float:
        parts = artifacts.task.get("harbor") or {}
        if not parts.get("tests"):
            raise EvaluationError("task is not a Harbor task (no tests directory)")
        if not artifacts.sandbox.confined:
            raise EvaluationError("a Harbor task's tests run at /tests and /app: it needs a sandbox (bwrap)")
        with ScoringSession(artifacts, self.timeout_s, self.copy_s) as session:
            work = session.copy()
            tests = session.inputs / "tests"
            shutil.copytree(parts["tests"], tests, symlinks=False)
            logs = session.dir / "logs"
            logs.mkdir(mode=0o755)
            guard = _guard(logs, session)
            session.place(Mount(tests, Path(TESTS)), Mount(logs, Path(LOGS), writable=True))
            env = {**VERIFIER_ENV, **parts.get("verifier_env", {})}
            # The task's own limit, within the recipe's for any evaluation.
            timeout = min(parts.get("verifier_timeout_s") or self.timeout_s, self.timeout_s)
            try:  # `exec`: test.sh's shell is the sandbox's pid 2, which the guard knows it by
                b = session.ready(session.run(work, command(f"exec bash {TESTS}/test.sh"), timeout, **env))
            finally:
                if guard is not None:
                    guard.close()
            if guard is not None and guard.denied:
                pid, path = guard.denied[0]
                b = replace(b, output=b.output + f"\n{len(guard.denied)} opens of the reward refused "
                            f"(a process not test.sh's own: pid {pid}, {path})")  # fmt: skip
            if b.killed:
                raise WorkspaceFault(f"the tests were {b.why()} on the workspace's code")
            if b.exit_code != 0:
                raise WorkspaceFault(f"tests/test.sh failed ({b.why()})")
            return reward(logs, b.why())


REWARDS = ("reward.json", "reward.txt")
SHELL_PID = 2
"""test.sh's shell in the sandbox's pid namespace: bwrap's init is 1, the command it runs 2."""


def _guard(logs: Path, session: ScoringSession) -> OpenGuard | None:
    """Make ``logs`` for the tests, and guard its reward files where the runtime can (root, bwrap):
    the directory root's and sticky, the reward files root's, made now and empty, and opened only
    by test.sh's shell or a process it started itself. Elsewhere the directory is the sandbox
    user's, unguarded."""
    owner = session.sandbox.owner_in(session.group)
    if owner is not None and os.geteuid() == 0 and session.sandbox.kind == "bwrap":
        logs.chmod(0o1777)  # root's and sticky: a name of root's is neither removed nor renamed over
        files = [logs / name for name in REWARDS]
        for f in files:
            f.touch(mode=0o666)
            f.chmod(0o666)
        guard = OpenGuard.start(files, _tests_own)
        if guard is not None:
            return guard
        for f in files:
            f.unlink()
        logs.chmod(0o755)
    if owner is not None:
        os.chown(logs, owner, owner)
    return None


def _tests_own(pid: int) -> bool:
    """Whether ``pid`` is test.sh's shell, or a process that shell started itself (a redirection,
    a command of its own): not a process the tested code started, nor one left to the sandbox's
    init when its parent ended."""
    depth = ns_pid(os.getpid())[1] + 1  # the sandbox's pid namespace is one below ours
    for p in (pid, parent(pid)):
        inner, levels = ns_pid(p)
        if levels == depth and inner == SHELL_PID:
            return True
    return False


def reward(logs: Path, ended: str) -> float:
    """The reward the tests left in ``logs``: reward.json's ``reward`` (or its one number), else
    reward.txt's number. Where both are there they must agree: a reward.json the tested code
    wrote beside the tests' reward.txt does not outrank it."""
    found = {name: _read(logs, name) for name in ("reward.json", "reward.txt")}
    values = {name: x for name, x in found.items() if x is not None}
    if not values:
        raise WorkspaceFault(f"the tests wrote no reward ({ended})")
    if len(set(values.values())) > 1:
        raise WorkspaceFault(f"{LOGS}/reward.json and reward.txt disagree ({values['reward.json']!r} and "
                             f"{values['reward.txt']!r})")  # fmt: skip
    return next(iter(values.values()))


def _read(logs: Path, name: str) -> float | None:
    data = untrusted.read(logs, name, REWARD_BYTES + 1)
    if data is None:
        if os.path.lexists(logs / name):
            raise WorkspaceFault(f"{LOGS}/{name} is not a regular file")
        return None
    if not data.strip():  # made empty by the runtime (``_guard``), and not written
        return None
    if len(data) > REWARD_BYTES:
        raise WorkspaceFault(f"{LOGS}/{name} is over {REWARD_BYTES} bytes")
    text = data.decode(errors="replace").strip()
    value: object = text
    if name == "reward.json":
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            raise WorkspaceFault(f"{LOGS}/reward.json is not JSON") from None
        numbers = {k: v for k, v in obj.items() if _number(v)} if isinstance(obj, dict) else {}
        if not isinstance(obj, dict) or ("reward" not in obj and len(numbers) != 1):
            raise WorkspaceFault(f'{LOGS}/reward.json must hold {{"reward": x}}')
        value = obj["reward"] if "reward" in obj else next(iter(numbers.values()))
    try:
        x = float(value) if not isinstance(value, bool) else math.nan  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise WorkspaceFault(f"{LOGS}/{name} holds {text[:40]!r}, not a number") from None
    if not (math.isfinite(x) and 0.0 <= x <= 1.0):
        raise WorkspaceFault(f"{LOGS}/{name} holds {x!r}, not a reward in [0, 1]")
    return x


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
