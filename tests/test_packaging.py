"""Everything the package imports is a declared runtime dependency (not just a test extra)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib

from conftest import REPO

OPTIONAL = {"sglang", "megatron", "pyverbs"}  # extras, imported only where they are used


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
