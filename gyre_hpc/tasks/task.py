"""A task, and its JSON form: one line of the suite files users bring (``tasks.jsonl`` reads them).

One task per line::

    {"id": "calc-1",
     "spec": "Create a package `calc` with add(a, b) ...",            # natural language
                                                  # ("instruction" is the same, for agent CLIs)
     "seed": {"files": {"README.md": "..."}} | {"dir": "seeds/calc"}, # workspace seed (optional)
     "scorer": "hidden-tests" | "milestones" | "package.module:Class",
     "hidden_checks": [{"module": "calc", "call": "add(2, 3)", "expect": "5"}, ...],
     "hidden_tests": {"files": {"test_calc.py": "..."}} | {"dir": "hidden/calc"},
     "hidden_test_count": 12,                                          # optional
     "visible_tests": {"files": {...}} | {"dir": ...},                 # copied into tests_visible/
     "milestones": [{"weight": 1, "file_exists": "out.txt"}, ...],    # for the milestones scorer
     "answers": ["geese"],                    # a question answered in one reply, no tools (reply scorer)
     "setup": "git init -q && pip install -q -e .",                   # run in the workspace first
     "verifier": "$GYRE_PYTEST tests",                                # the verifier scorer's check
     "timeout_s": 1800,
     "workdir": "/app",                       # where the workspace appears in the sandbox (optional)
     "image": "images/calc-rootfs.tar"}       # the task's own system (optional; sandbox.image)

``hidden_checks`` are what a reward the policy cannot forge needs: each call is evaluated in the
scoring sandbox, and its value compared with ``expect`` (a Python literal) outside it, types
included (``scoring.checks``). ``hidden_tests`` are pytest files, run in the same process as the
code they test: they resist every generic way to forge a result (``scoring.testbench``), but not
code written against our runner in particular. Both score with ``hidden-tests``.

A task with a ``verifier`` and no ``scorer`` is scored by it (``scoring.builtin.VerifierScorer``):
its reward is its last line of output if it exits 0, else 0. A verifier must not take its verdict
from the workspace's code: ``pytest -q tests && echo 1`` passes when the tested code ends pytest
with status 0 while it is collected; ``$GYRE_PYTEST tests`` (the scorer's own runner, last) prints
the fraction passed after every process of the tested code is gone. A milestone that calls the
workspace's code is a ``check`` (``{"check": {"module": …, "call": …, "expect": …}}``).
``setup`` runs in the seeded workspace before the agent starts (an execution whose setup fails
is ``crashed``). Together they let a suite carry what an external harness needs without hidden
test files: ``examples/verifier-tasks.jsonl``.

``dir`` paths are relative to the JSONL file. Unknown keys are refused with the list of valid
ones, so a misspelt key never silently drops a verifier.

The formats users bring are read into the same record: a line with ``instance_id`` is a
SWE-bench-style instance (``tasks.swe``; its repository work is ``tasks.swe_repo``), and a
suite path that is a directory holds Harbor tasks (``tasks.harbor``). Their format-specific
parts (``format``, ``harbor``, ``swe``) are not keys of this JSONL.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gyre_hpc.errors import GyreError
from gyre_hpc.tasks import swe_repo

VISIBLE_DIR = "tests_visible"


@dataclass(frozen=True)
class Task:
    id: str
    spec: str
    scorer: str = ""
    """Scorer name or module:Class; empty: the recipe's ``scoring.scorer``."""
    seed: dict[str, str] = field(default_factory=dict)
    hidden_checks: list[dict[str, str]] = field(default_factory=list)
    """Calls into the workspace's code and the values they must return (``scoring.checks``)."""
    hidden_tests: dict[str, str] = field(default_factory=dict)
    hidden_test_count: int = 0
    visible_tests: dict[str, str] = field(default_factory=dict)
    milestones: list[dict[str, Any]] = field(default_factory=list)
    timeout_s: float | None = None
    setup: str = ""
    """A shell command run in the seeded workspace before the agent starts."""
    verifier: str = ""
    """A shell command run in a copy of the finished workspace (the ``verifier`` scorer), in the
    run's sandbox: a script of its own is there if its directory is in ``scoring.sandbox_binds``."""
    workdir: str = ""
    """Where the workspace appears inside the sandbox (an absolute path, e.g. ``/app``); empty: at
    its host path. Needs a sandbox (bwrap or apptainer)."""
    image: str = ""
    """The task's image (``sandbox.image``): a root filesystem directory or tarball, or an
    Apptainer reference; empty: the sandbox's own system."""
    format: str = ""
    """Where the task came from: empty (this JSONL), ``harbor`` or ``swe``."""
    harbor: dict[str, Any] = field(default_factory=dict)
    """A Harbor task's own parts (``tasks.harbor.HarborParts`` as a dict)."""
    swe: dict[str, Any] = field(default_factory=dict)
    """A SWE-bench-style instance's own parts (``tasks.swe.SweParts`` as a dict)."""
    answers: list[str] = field(default_factory=list)
    """A question answered in one reply, without tools: the replies that are right (the
    ``reply`` scorer). Empty: a task done with tools in the workspace."""

    @property
    def test_command(self) -> str | None:
        return f"python -m pytest -q {VISIBLE_DIR}" if self.visible_tests else None

    def materialize(self, workspace: Path) -> None:
        """Lay out the workspace seed (and visible tests) for one execution."""
        if self.swe:
            swe_repo.seed(self.swe, self.id, workspace)
        workspace.mkdir(parents=True, exist_ok=True)
        for rel, content in self.seed.items():
            _write(workspace / rel, content)
        for rel, content in self.visible_tests.items():
            _write(workspace / VISIBLE_DIR / rel, content)

    def for_scorer(self, task_dir: Path) -> dict[str, Any]:
        """What the scorer needs, with hidden tests written where the agent cannot see them."""
        out: dict[str, Any] = {
            "id": self.id,
            "milestones": self.milestones,
            "hidden_checks": self.hidden_checks,
            "hidden_test_count": self.hidden_test_count,
            "verifier": self.verifier,
            "workdir": self.workdir,
            "image": self.image,
            "harbor": self.harbor,
            "answers": self.answers,
        }
        if self.swe:
            out["swe"] = swe_repo.for_scorer(self.swe, task_dir / self.id)
        if self.hidden_tests:
            hidden = task_dir / self.id / "hidden"
            if not hidden.exists():
                for rel, content in self.hidden_tests.items():
                    _write(hidden / rel, content)
            out["hidden_tests"] = str(hidden)
        return out

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "spec": self.spec, "scorer": self.scorer}
        for key in ("seed", "hidden_tests", "visible_tests"):
            if getattr(self, key):
                d[key] = {"files": getattr(self, key)}
        for key in (
            "hidden_checks",
            "hidden_test_count",
            "milestones",
            "timeout_s",
            "setup",
            "verifier",
            "workdir",
            "answers",
        ):
            if getattr(self, key):
                d[key] = getattr(self, key)
        return d


def _write(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)


_VALID = [f.name for f in fields(Task) if f.name not in ("format", "harbor", "swe")]
TASK_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,95}")
MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def task_from_json(d: Mapping[str, Any], base: Path, where: str) -> Task:
    unknown = set(d) - set(_VALID) - {"instruction"}
    if unknown:
        valid = ", ".join([*_VALID, "instruction"])
        raise GyreError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; valid keys: {valid}")
    if "instruction" in d:
        if "spec" in d:
            raise GyreError(f"{where}: give spec or instruction (the same field), not both")
        d = {**{k: v for k, v in d.items() if k != "instruction"}, "spec": d["instruction"]}
    if d.get("verifier") and not d.get("scorer"):
        d = {**d, "scorer": "verifier"}
    for key in ("id", "spec"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise GyreError(f"{where}: {key} must be a non-empty string")
    answers = d.get("answers", [])
    if not isinstance(answers, list) or not all(isinstance(a, str) and a.strip() for a in answers):
        raise GyreError(f"{where}: answers must be a list of non-empty strings (the right replies)")
    if answers and not d.get("scorer"):
        d = {**d, "scorer": "reply"}
    for key in ("setup", "verifier"):
        if not isinstance(d.get(key, ""), str):
            raise GyreError(f"{where}: {key} must be a shell command (a string)")
    if d.get("workdir"):
        check_workdir(d["workdir"], f"{where}: workdir")
    if not isinstance(d.get("image", ""), str):
        raise GyreError(f"{where}: image must be a string (a root filesystem path, a tarball, docker://…)")
    if not TASK_ID.fullmatch(d["id"]):  # it names runs and workspaces: a name, not a path
        raise GyreError(f"{where}: id {d['id']!r} is not valid: letters, digits and ._- (at most 96)")
    values = dict(d)
    if values.get("image"):
        values["image"] = image_path(values["image"], base)
    if "hidden_checks" in values:
        values["hidden_checks"] = _checks(values["hidden_checks"], f"{where}: hidden_checks")
    for key in ("seed", "hidden_tests", "visible_tests"):
        if key in values:
            values[key] = _files(values[key], base, f"{where}: {key}")
    return Task(**values)


RESERVED = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev", "tmp", "run")
"""Top-level directories a sandbox provides itself: no task's workdir lies under them."""


def image_path(ref: str, base: Path) -> str:
    """An image reference with a relative path made absolute (relative to the task's file)."""
    if not ref or "://" in ref or ref.startswith("/"):
        return ref
    local = base / ref
    return str(local.resolve()) if local.exists() else ref


def check_workdir(value: Any, where: str) -> str:
    """A task's working directory inside the sandbox: an absolute, normal path outside the system."""
    p = Path(value) if isinstance(value, str) else None
    if p is None or not p.is_absolute() or ".." in p.parts or str(p) != value.rstrip("/") or len(p.parts) < 2:
        raise GyreError(f"{where} = {value!r}: an absolute path such as /app")
    if p.parts[1] in RESERVED:
        raise GyreError(f"{where} = {value!r}: not under /{p.parts[1]}, which the sandbox provides itself")
    return value


def _checks(checks: Any, where: str) -> list[dict[str, str]]:
    """A task's ``hidden_checks``, validated: one line naming what is wrong."""
    if not isinstance(checks, list):
        raise GyreError(f'{where} must be a list of {{"module": …, "call": …, "expect": …}}')
    out = []
    for i, c in enumerate(checks):
        at = f"{where}[{i}]"
        if not isinstance(c, dict) or set(c) != {"module", "call", "expect"}:
            raise GyreError(f'{at} must be {{"module": "pkg.mod", "call": "f(1, 2)", "expect": "3"}}')
        if not all(isinstance(c[k], str) for k in c):
            raise GyreError(f"{at}: module, call and expect are strings")
        if not MODULE.fullmatch(c["module"]):
            raise GyreError(f"{at}: module {c['module']!r} is not a dotted module name")
        try:
            ast.parse(c["call"], mode="eval")
        except SyntaxError:
            raise GyreError(f"{at}: call {c['call']!r} is not a Python expression") from None
        try:
            ast.literal_eval(c["expect"])
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            raise GyreError(f"{at}: expect {c['expect']!r} is not a Python literal") from None
        out.append(dict(c))
    return out


def _files(spec: Any, base: Path, where: str) -> dict[str, str]:
    if isinstance(spec, dict) and isinstance(spec.get("files"), dict):
        return {str(k): str(v) for k, v in spec["files"].items()}
    if isinstance(spec, dict) and isinstance(spec.get("dir"), str):
        root = (base / spec["dir"]).resolve()
        if not root.is_dir():
            raise GyreError(f"{where}: directory {root} does not exist")
        return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}
    raise GyreError(f'{where}: expected {{"files": {{path: content}}}} or {{"dir": "relative/path"}}')
