"""SWE-bench-style instances (one JSONL line each), read as tasks.

```
 {"instance_id": "minicalc-1",
  "repo": "repos/minicalc",          # a local git repository (relative to the JSONL), or a
                                     # directory holding the repository at its base commit
  "base_commit": "3f2a…",            # the repository's commit the workspace starts from
  "problem_statement": "…",          # the agent's instruction
  "test_patch": "diff --git …",      # the tests that decide, applied only when scoring
  "FAIL_TO_PASS": ["tests/test_calc.py::test_div_by_zero"],  # pytest node ids (a list, or a
  "PASS_TO_PASS": ["tests/test_calc.py::test_add"],          # JSON string of one, as SWE-bench ships)
  "patch": "diff --git …",           # the reference fix (optional)
  "image": ""}                       # the instance's environment image (optional)
```

The workspace is the repository's tree at ``base_commit`` and nothing of its history: a fresh
git repository with that tree as its one commit, so ``git diff`` shows the agent's change and no
later commit (where the fix lives) can be found. Scoring (``scoring.swe``) restores every file
the test patch touches and every ``conftest.py`` to the base, applies the test patch, and runs
the named tests: a ``PASS_TO_PASS`` test that fails scores 0 (a regression), otherwise the
score is the fraction of ``FAIL_TO_PASS`` that pass — 1.0 is SWE-bench's "resolved".

What it does not know: test runners other than pytest (node ids are pytest's), and the
repository's own pytest configuration (the scorer's ini replaces it, as for hidden tests).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gyre_hpc.errors import GyreError
from gyre_hpc.tasks import swe_repo
from gyre_hpc.tasks.task import TASK_ID, Task, image_path

KEYS = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS",
        "PASS_TO_PASS", "patch", "image")  # fmt: skip
IGNORED = ("hints_text", "created_at", "version", "environment_setup_commit")
"""SWE-bench fields kept by datasets that nothing here uses."""


@dataclass(frozen=True)
class SweParts:
    repo: str
    """Host path of the repository (git) or of its tree at the base commit (a directory)."""
    base_commit: str
    test_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    patch: str = ""
    image: str = ""


def task_from_record(d: Mapping[str, Any], base: Path, where: str) -> Task:
    """One instance, validated: one line naming the field that is wrong."""
    if unknown := sorted(set(d) - set(KEYS) - set(IGNORED)):
        raise GyreError(f"{where}: unknown key {unknown[0]}; valid keys of an instance: {', '.join(KEYS)}")
    for key in ("instance_id", "repo", "problem_statement", "test_patch"):
        if not isinstance(d.get(key), str) or not d[key].strip():
            raise GyreError(f"{where}: {key} must be a non-empty string")
    iid = d["instance_id"]
    if not TASK_ID.fullmatch(iid):
        raise GyreError(f"{where}: instance_id {iid!r} is not valid: letters, digits and ._- (at most 96)")
    for key in ("base_commit", "patch", "image"):
        if not isinstance(d.get(key, ""), str):
            raise GyreError(f"{where}: {key} must be a string")
    repo = (base / d["repo"]).resolve()
    commit = d.get("base_commit", "")
    if swe_repo.is_git(repo):
        if not commit:
            raise GyreError(f"{where}: base_commit is empty; {repo} is a git repository: name the commit")
        if swe_repo.git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode:
            raise GyreError(f"{where}: base_commit {commit} is not a commit of {repo}")
    elif not repo.is_dir():
        raise GyreError(f"{where}: repo {d['repo']!r} is neither a git repository nor a directory ({repo})")
    if not d["test_patch"].lstrip().startswith(("diff ", "--- ")):
        raise GyreError(f"{where}: test_patch is not a unified diff")
    f2p, p2p = (_ids(d.get(k, []), f"{where}: {k}") for k in ("FAIL_TO_PASS", "PASS_TO_PASS"))
    if not f2p:
        raise GyreError(f"{where}: FAIL_TO_PASS is empty (the tests the fix must make pass)")
    image = image_path(d.get("image", ""), base)
    parts = SweParts(str(repo), commit, d["test_patch"], f2p, p2p, d.get("patch", ""), image)
    spec = d["problem_statement"]
    return Task(id=iid, spec=spec, scorer="swe", image=image, format="swe", swe=asdict(parts))


def _ids(value: Any, where: str) -> list[str]:
    if isinstance(value, str):  # SWE-bench ships them as JSON strings
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise GyreError(f"{where}: not a list of test ids (nor a JSON string of one)") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise GyreError(f'{where}: a list of pytest node ids such as "tests/test_x.py::test_y"')
    for v in value:
        path = v.split("::", 1)[0]
        if Path(path).is_absolute() or ".." in Path(path).parts:
            raise GyreError(f"{where}: {v!r} leaves the repository")
    return list(value)
