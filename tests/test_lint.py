"""The code base stays lint-clean (ruff, configured in pyproject.toml), and no test decides by
itself to skip: capabilities go through the markers and ``conftest.missing`` (``GYRE_REQUIRE``)."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO


def test_ruff_check() -> None:
    """ruff comes with the test tools (``pip install -e '.[test]'``), as pytest does."""
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "gyre_hpc", "tests", "tools"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


SKIPS = re.compile(r"pytest\.skip\(|importorskip\(|mark\.skipif\(|mark\.skip\(|mark\.xfail\(")


def test_no_test_skips_by_itself() -> None:
    """A skip outside ``conftest`` would hide a missing capability from ``GYRE_REQUIRE``."""
    found = [
        f"{path.name}:{n}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        if path.name != "conftest.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if SKIPS.search(line) and "SKIPS" not in line
    ]
    assert found == []
