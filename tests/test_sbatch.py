"""The het-job script is a pure function of the recipe, checked against golden files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import REPO, gyre

from gyre_hpc.launch.sbatch import render_sbatch
from gyre_hpc.recipe import load_recipe
from gyre_hpc.runtime.world import Layout

GOLDEN = Path(__file__).parent / "golden"
FIXED = ["--set", "run.runs_dir=/shared/runs", "--set", "slurm.python=/opt/gyre/bin/python"]


@pytest.mark.parametrize("recipe", ["smoke", "qwen3-8b-8cells"])
def test_dry_run_matches_golden(recipe: str) -> None:
    proc = gyre("submit", f"recipes/{recipe}.toml", "--dry-run", *FIXED)
    assert proc.returncode == 0, proc.stderr
    golden = GOLDEN / f"{recipe}.sbatch"
    if os.environ.get("GYRE_UPDATE_GOLDEN"):
        golden.write_text(proc.stdout)
    assert proc.stdout == golden.read_text()


def test_components_follow_the_rank_order() -> None:
    r = load_recipe(
        REPO / "recipes" / "qwen3-8b-8cells.toml", ["cells.rollout_pool=2", "slurm.nodes_per_cell=2"]
    )
    text = render_sbatch(r.slurm, Layout.from_config(r.cells), job_name="j", run_dir=Path("/r"), python="py")
    components = text.split("#SBATCH hetjob")
    assert len(components) == 3
    assert "--ntasks=1\n" in components[0] and "--partition=cpu" in components[0]
    assert "--nodes=16\n" in components[1] and "--ntasks=64\n" in components[1]
    assert "--ntasks-per-node=4\n" in components[1] and "--gpus-per-node=8" in components[1]
    assert "--nodes=2\n" in components[2] and "--ntasks=2\n" in components[2]
    assert "srun --mpi=pmix --het-group=0,1,2 " in text
    assert "%j" not in text  # expands per component: never in a path they share


def test_dry_run_submits_nothing(tmp_path: Path) -> None:
    proc = gyre("submit", str(REPO / "recipes" / "smoke.toml"), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("#!/bin/bash")
    assert not (tmp_path / "runs").exists()
