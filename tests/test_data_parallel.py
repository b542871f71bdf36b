"""Data-parallel training over the MPI transport: same step as one cell, every micro-step once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_hpc.models.tiny import init_tiny

HERE = Path(__file__).parent
MPIRUN = ["mpirun", "--oversubscribe", "-n"]
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def mpirun(n: int, program: str, *args: str, timeout: float = 240) -> None:
    proc = subprocess.run(
        [*MPIRUN, str(n), sys.executable, str(HERE / "mpi_programs" / program), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **ROOT_OK},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.mpi
def test_core_plus_satellites_give_the_core_alone_step(tmp_path: Path) -> None:
    model = init_tiny(tmp_path / "tiny", seed=3)
    verdict = tmp_path / "verdict.json"
    mpirun(4, "data_parallel_step.py", str(model), str(verdict))
    v = json.loads(verdict.read_text())
    core, late, slow = v["claimed"]
    # Every micro-step trained exactly once, whoever claimed it.
    assert sorted(core + late + slow) == list(range(v["micro_steps"]))
    assert core and late and slow, v["claimed"]
    assert min(late) > 0, "the late cell joined mid-batch"
    assert len(core) > len(slow), "the slow cell should take fewer micro-steps"
    # Same summed gradient (float32, summation order differs) and same updated weights.
    assert v["grad_rel_err"] < 1e-5
    assert v["weight_max_abs_err"] < 1e-6, v
    assert v["version"] == 1
