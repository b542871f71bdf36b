"""A SWE-bench-style instance's repository (``tasks.swe``): its tree at the base commit, the
workspace seeded from it, and the files scoring restores (``scoring.swe``).

What it does not know: the instance's JSONL fields (``tasks.swe`` validates them into the
``parts`` mapping every function here takes) and how a workspace is scored.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gyre_hpc.errors import GyreError

GIT = ["git", "-c", "user.name=gyre", "-c", "user.email=gyre@localhost", "-c", "init.defaultBranch=main"]


def is_git(path: Path) -> bool:
    return (path / ".git").exists() or (path / "HEAD").is_file() and (path / "objects").is_dir()


def git(repo: Path, *args: str, stdout: int = subprocess.DEVNULL) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*GIT, "-C", str(repo), *args], stdout=stdout, stderr=subprocess.DEVNULL, check=False
    )


def base_tree(parts: Mapping[str, Any], dest: Path) -> None:
    """The repository's tree at the base commit, written to ``dest`` (which must not exist)."""
    repo = Path(parts["repo"])
    if not is_git(repo):
        shutil.copytree(repo, dest, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        return
    tar = git(repo, "archive", "--format=tar", parts["base_commit"], stdout=subprocess.PIPE)
    if tar.returncode:
        raise GyreError(f"{repo}: git archive {parts['base_commit']} failed")
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(dest, filter="data")


def seed(parts: Mapping[str, Any], task_id: str, workspace: Path) -> None:
    """The workspace of an execution: the base tree, as the one commit of a fresh repository."""
    if workspace.exists():
        return
    base_tree(parts, workspace)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "--no-verify", "-m", "base"]):
        if git(workspace, *args).returncode:
            raise GyreError(f"{workspace}: git {args[0]} failed while seeding {task_id}")


def touched(patch: str) -> list[str]:
    """The paths a unified diff changes, creates or deletes (both sides of a rename)."""
    out: list[str] = []
    for line in patch.splitlines():
        if line.startswith(("--- ", "+++ ")):
            name = line[4:].split("\t")[0].strip()
            if name != "/dev/null":
                out.append(name[2:] if name[:2] in ("a/", "b/") else name)
    return list(dict.fromkeys(out))


def for_scorer(parts: Mapping[str, Any], cache: Path) -> dict[str, Any]:
    """What ``scoring.swe`` needs: the base tree's conftest files and the files the test patch
    touches as they are once it is applied (prepared once per task into ``cache``, outside any
    sandbox: both come from the task, not the workspace), and the tests that decide."""
    ready = cache / "swe.json"
    if not ready.is_file():
        ready.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="gyre-swe-") as tmp:
            tree = Path(tmp) / "tree"
            base_tree(parts, tree)
            conftests = {
                str(p.relative_to(tree)): p.read_text(errors="replace") for p in tree.rglob("conftest.py")
            }
            patch = Path(tmp) / "test.patch"
            patch.write_text(parts["test_patch"])
            applied = subprocess.run(
                ["git", "apply", "--whitespace=nowarn", str(patch)], cwd=tree, capture_output=True, text=True,
                env={**os.environ, "GIT_DIR": str(Path(tmp) / "no-repo")},
            )  # fmt: skip
            if applied.returncode:
                why = applied.stderr.strip().splitlines()[:1] or ["?"]
                raise GyreError(
                    f"{cache.name}: test_patch does not apply to {parts['repo']} at the base: {why[0]}"
                )
            files = {rel: (tree / rel).read_text(errors="replace") if (tree / rel).is_file() else None
                     for rel in touched(parts["test_patch"])}  # fmt: skip
        # Executions of one task may score at once: each writes its own file, the rename is atomic.
        fd, tmp_ready = tempfile.mkstemp(dir=ready.parent, prefix=".swe-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"conftests": conftests, "tests": files}))
        os.replace(tmp_ready, ready)
    prepared = json.loads(ready.read_text())
    return {**prepared, "fail_to_pass": parts["fail_to_pass"], "pass_to_pass": parts["pass_to_pass"]}
