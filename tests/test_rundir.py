"""The run directory's file names are written once, in ``gyre_hpc/rundir.py``: every other module
reaches them through ``RunDir`` (a grep of the package, docstrings aside, shows it)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from conftest import REPO

from gyre_hpc.rundir import RunDir

FILES = (
    "recipe.toml", "resumes.jsonl", "events.jsonl", "tito.bin", "tito-", "proxy.secret", "chats.jsonl",
    "chats-", "spec.json", "worker-", "step-", "metrics.png", "unit-", "hub.json", "job.json",
    "mpirun.log", "slurm.out", "rank-", ".exit", "executor-", "proxy-worker-", "state.json",
    "executions.jsonl", "eval.json", "job.sbatch",
)  # fmt: skip
"""Names (or the start of names) of the run directory's files."""
DIRS = (
    "workspaces", "checkpoints", "logs", "ranks", "journal", "engines", "tasks", "proxy", "executors",
    "requeue", "executions",
)  # fmt: skip
"""Its folders: words too common to grep alone, caught where a path is built from a run's."""


def named_outside_rundir(source: str) -> list[str]:
    """The run-directory names a module's code spells (its docstrings may)."""
    tree = ast.parse(source)
    docs = {
        id(stmt.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        for stmt in node.body
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found += [f"{node.lineno}: {name!r}" for name in FILES if name in node.value]
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and isinstance(node.right, ast.Constant)
            and node.right.value in DIRS
            and any(w in ast.unparse(node.left) for w in ("run_dir", "rundir", "RunDir", ".path"))
        ):
            found.append(f"{node.lineno}: {node.right.value!r} under a run directory")
    return found


def test_only_rundir_names_the_run_directory_s_files() -> None:
    spelled = {
        str(path.relative_to(REPO)): found
        for path in sorted((REPO / "gyre_hpc").rglob("*.py"))
        if path.name != "rundir.py" and (found := named_outside_rundir(path.read_text()))
    }
    assert spelled == {}


def test_the_check_sees_a_name_spelled_elsewhere() -> None:
    """What the package used to do: a rank's log, a worker's address and a journal by hand."""
    planted = '''
def f(run_dir, i):
    """Docstrings may say logs/rank-0.log."""
    a = run_dir.logs / f"rank-{i}.log"
    b = run_dir.proxy_workers / f"worker-{i}.json"
    c = run_dir.path / "journal"
'''
    assert sorted(named_outside_rundir(planted)) == [
        "4: 'rank-'", "5: 'worker-'", "6: 'journal' under a run directory",
    ]  # fmt: skip


def test_runs_under_a_folder_are_found_oldest_first(tmp_path: Path) -> None:
    older, newer = RunDir.create(tmp_path, "a", now=0), RunDir.create(tmp_path, "b", now=1)
    older.write_job(job_id="7")
    newer.events.write_text("")
    os.utime(older.job_path, (1, 1))
    os.utime(newer.events, (2, 2))
    (tmp_path / "not-a-run").mkdir()
    assert [r.path for r in RunDir.under(tmp_path)] == [older.path, newer.path]
    assert (
        RunDir(tmp_path / "not-a-run").missing()
        == f"{tmp_path / 'not-a-run'} is not a run directory (no recipe.toml)"
    )
