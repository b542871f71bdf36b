"""The het-job script is a pure function of the recipe, checked against golden files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, assert_golden, gyre

from gyre_hpc.launch.sbatch import render_sbatch
from gyre_hpc.plan.ranks import RankLayout
from gyre_hpc.recipe import load_recipe

FIXED = ["--set", "run.runs_dir=/shared/runs", "--set", "slurm.python=/opt/gyre/bin/python"]


PER_TASK = ["slurm.gpus_per_node=0", "slurm.gpu_per_task=true", "engine.tp_size=1"]
"""A site that binds GPUs to tasks: one a cell rank, an engine on one GPU."""

SPANNING = [
    "slurm.nodes_per_cell=2",
    "slurm.gpus_per_node=4",
    "engine.tp_size=8",
    "engine.weight_sync=disk",
]
"""Cells of two 4-GPU nodes, each served by one replica across both (its weights from disk)."""

EXECUTORS = [
    "executors.nodes=4",
    "executors.cpus_per_node=32",
    "executors.partition=cpu",
    "executors.mem=128G",
    "proxy.host=0.0.0.0",
]
"""Executions on four CPU nodes of their own partition, outside the MPI world."""


@pytest.mark.parametrize(
    ("recipe", "sets", "golden"),
    [("smoke", [], "smoke"), ("qwen3-8b-8cells", [], "qwen3-8b-8cells"),
     ("qwen3-8b-8cells", PER_TASK, "qwen3-8b-8cells-gpu-per-task"),
     ("qwen3-8b-8cells", SPANNING, "qwen3-8b-8cells-engines-across-nodes"),
     ("qwen3-8b-8cells", EXECUTORS, "qwen3-8b-8cells-executors")],
)  # fmt: skip
def test_dry_run_matches_golden(recipe: str, sets: list[str], golden: str) -> None:
    extra = [arg for s in sets for arg in ("--set", s)]
    proc = gyre("submit", f"recipes/{recipe}.toml", "--dry-run", *FIXED, *extra)
    assert proc.returncode == 0, proc.stderr
    assert_golden(f"{golden}.sbatch", proc.stdout)
    # Every rank's NCCL alike, set before the world starts (not only where a server runs).
    said = proc.stdout.index("export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}")
    assert said < proc.stdout.index("srun --mpi=")


@pytest.mark.parametrize(
    ("sets", "says"),
    [(["slurm.gpu_per_task=true"], "ask for GPUs one way"),
     (["slurm.gpus_per_node=0", "slurm.gpu_per_task=true"], "span GPUs bound to other tasks")],
)  # fmt: skip
def test_gpus_asked_two_ways_or_hidden_from_the_server_are_one_line(sets: list[str], says: str) -> None:
    extra = [arg for s in sets for arg in ("--set", s)]
    proc = gyre("submit", "recipes/qwen3-8b-8cells.toml", "--dry-run", *FIXED, *extra)
    assert proc.returncode == 2 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_executor_nodes_with_a_proxy_on_loopback_are_one_line() -> None:
    proc = gyre("submit", "recipes/smoke.toml", "--dry-run", *FIXED, "--set", "executors.nodes=2")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert 'cannot reach a proxy on loopback; set proxy.host = "0.0.0.0"' in proc.stderr


def test_components_follow_the_rank_order() -> None:
    r = load_recipe(
        REPO / "recipes" / "qwen3-8b-8cells.toml", ["cells.rollout_pool=2", "slurm.nodes_per_cell=2"]
    )
    text = render_sbatch(
        r.slurm, RankLayout.from_config(r.cells), job_name="j", run_dir=Path("/r"), python="py"
    )
    components = text.split("#SBATCH hetjob")
    assert len(components) == 3
    assert "--ntasks=1\n" in components[0] and "--partition=cpu" in components[0]
    assert "--nodes=16\n" in components[1] and "--ntasks=64\n" in components[1]
    assert "--ntasks-per-node=4\n" in components[1] and "--gpus-per-node=8" in components[1]
    assert "--nodes=2\n" in components[2] and "--ntasks=2\n" in components[2]
    # One srun; each part its component's tasks with that component's CPUs.
    parts = text.split("srun --mpi=pmix --kill-on-bad-exit=1 \\\n")[1].split(" &\n")[0].split(" : \\\n")
    run = '"$PYTHON" -m gyre_hpc.runtime "$RUN_DIR"'
    assert [p.strip() for p in parts] == [
        f"--het-group=0 --cpus-per-task=32 {run}",
        f"--het-group=1 --cpus-per-task=12 {run}",
        f"--het-group=2 --cpus-per-task=12 {run}",
    ]
    assert "%j" not in text  # expands per component: never in a path they share


def test_dry_run_submits_nothing(tmp_path: Path) -> None:
    proc = gyre("submit", str(REPO / "recipes" / "smoke.toml"), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("#!/bin/bash")
    assert not (tmp_path / "runs").exists()


def run_script_with_fake_srun(
    tmp_path: Path, srun_body: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run the rendered script with ``srun`` replaced at the subprocess boundary."""
    from gyre_hpc.rundir import RunDir

    run = RunDir.create(tmp_path, "fake")
    r = load_recipe(REPO / "recipes" / "smoke.toml")
    script = tmp_path / "job.sh"
    script.write_text(
        render_sbatch(
            r.slurm, RankLayout.from_config(r.cells), job_name="fake", run_dir=run.path, python=sys.executable
        )
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        f"#!/bin/bash\nfor r in 0 1 2; do echo 0 > {run.ranks}/rank-$r.exit; done\n{srun_body}\n"
    )
    (bin_dir / "srun").chmod(0o755)
    proc = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )
    return proc, run.events


@pytest.mark.slow
def test_script_stops_an_srun_that_outlives_every_rank(tmp_path: Path) -> None:
    """Slurm 22.05 + pmix sometimes leaves srun hanging after all tasks exited: the script must not."""
    from gyre_hpc.observability.events import read_events

    started = time.monotonic()
    proc, events = run_script_with_fake_srun(tmp_path, "exec sleep 600")
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 30
    assert "srun outlived every rank" in proc.stderr
    assert read_events(events)[-1].status == "completed"


def test_srun_crashing_after_every_rank_ended_does_not_fail_the_run(tmp_path: Path) -> None:
    """Seen here too: srun aborts ('double free', exit 134) at teardown of a finished het step."""
    from gyre_hpc.observability.events import read_events

    proc, events = run_script_with_fake_srun(tmp_path, "kill -ABRT $$")
    assert proc.returncode == 0, proc.stderr
    assert "srun exited 134 after every rank had ended (0)" in proc.stderr
    assert read_events(events)[-1].status == "completed"
