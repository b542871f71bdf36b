"""Everything the package imports is a declared runtime dependency (not just a test extra), and
the environment the README's first command builds scores what the run scores."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import REPO

OPTIONAL = {"sglang", "megatron", "pyverbs", "wandb"}  # extras, imported only where they are used


def imported_top_level_modules() -> set[str]:
    found = set()
    for path in (REPO / "gyre_hpc").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"gyre_hpc"} - OPTIONAL


def test_every_third_party_import_is_a_runtime_dependency() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    owners = md.packages_distributions()
    missing = {}
    for module in imported_top_level_modules():
        dists = {d.lower().replace("_", "-") for d in owners.get(module, [module])}
        if not dists & declared:
            missing[module] = sorted(dists)
    assert not missing, f"imported but not in [project].dependencies: {missing}"


HIDDEN = """
from calc import add

def test_add():
    assert add(2, 3) == 5

def test_zero():
    assert add(0, 0) == 0
"""


@pytest.mark.slow
@pytest.mark.bwrap
def test_the_environment_setup_sh_builds_alone_runs_every_built_in_scorer(tmp_path: Path) -> None:
    """What the README's first command builds (``tools/setup.sh``, no extras) is the scoring
    environment: the hidden-tests scorer's pytest is in it, so a correct solution scores 1.0 and a
    half-correct one 0.5, sandboxed, from that environment's ``gyre-hpc`` alone."""
    venv = tmp_path / "venv"
    built = subprocess.run(
        ["bash", "tools/setup.sh"], cwd=REPO, env={**os.environ, "GYRE_VENV": str(venv)},
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    tmp_path.chmod(0o755)
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "test_calc.py").write_text(HIDDEN)
    task = {
        "id": "calc",
        "spec": "Write calc.add(a, b).",
        "scorer": "hidden-tests",
        "hidden_tests": {"dir": "hidden"},
    }
    (tmp_path / "suite.jsonl").write_text(json.dumps(task) + "\n")
    shown = {}
    for name, body in (("right", "a + b"), ("half", "a * b")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "calc.py").write_text(f"def add(a, b):\n    return {body}\n")
        sets = ["--set", f"tasks.suite={tmp_path / 'suite.jsonl'}", "--set", "agent.sandbox=bwrap"]
        proc = subprocess.run(
            [str(venv / "bin" / "gyre-hpc"), "sandbox", "score", *sets, "--task", "calc",
             "--workspace", str(tmp_path / name)],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        shown[name] = proc.stdout.splitlines()[0]
    assert shown == {
        "right": "scored 1.000 (hidden-tests, 1 attempt)",
        "half": "scored 0.500 (hidden-tests, 1 attempt)",
    }
