"""The code base stays lint-clean (ruff, configured in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import REPO


def test_ruff_check() -> None:
    if shutil.which("ruff") is None and not (REPO / ".venv" / "bin" / "ruff").exists():
        pytest.skip("ruff not installed (pip install -e '.[test]')")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "gyre_hpc", "tests"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
