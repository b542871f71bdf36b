"""`gyre-hpc status --once` renders a frame from a run directory alone (finished or running)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import gyre

from gyre_hpc.recipe import load_recipe
from gyre_hpc.rundir import RunDir

T0 = 1_800_000_000.0
WIDE = {**os.environ, "COLUMNS": "160"}


def recorded_run(tmp_path: Path, finished: bool) -> RunDir:
    rd = RunDir.create(tmp_path, "rec")
    rd.write_recipe(load_recipe(Path("recipes/smoke.toml"), ["run.steps=2", "cells.count=3"]))
    events = [
        {"event": "run_start", "launcher": "mpirun"},
        *({"event": "hello", "cell": c, "rank": c + 1, "host": "n1", "capacity": 8} for c in range(3)),
        *({"event": "role_switched", "cell": c, "role": "sampling", "seq": c} for c in range(3)),
        {"event": "weights_loaded", "version": 0, "units": [0, 1, 2], "seconds": 0.01},
        {"event": "dispatched", "run": "r1", "d": 32, "p": 32, "f": 0},
        {"event": "finished", "run": "r1", "d": 32, "p": 32, "f": 20},
        {"event": "role_switched", "cell": 0, "role": "training", "seq": 4},
        {"event": "switch", "step": 1, "cell": 0, "kind": "sampling→training", "reason": "w", "seconds": 0.1},
        {
            "event": "step",
            "step": 1,
            "version": 1,
            "seconds": 11.0,
            "sample_seconds": 9.5,
            "reward_mean": 0.41,
            "pass_rate": 0.40,
            "micro_steps": 34,
            "claims": {"0": 21, "1": 13},
        },
        {"event": "eval", "step": 1, "pass_rate": 0.5, "n": 32},
    ]
    if finished:
        events.append({"event": "run_end", "status": "completed", "reason": ""})
    with rd.events.open("w") as fh:
        for i, e in enumerate(events):
            fh.write(json.dumps({"t": T0 + i, **e}) + "\n")
    return rd


def test_a_finished_run_renders_cells_water_steps_and_switches(tmp_path: Path) -> None:
    rd = recorded_run(tmp_path, finished=True)
    proc = gyre("status", str(rd.path), "--once", env=WIDE)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "run: completed · step 1/2" in out
    assert "water level 12 / rollout capacity 16" in out  # d 32 − f 20; cell 0 is training
    assert "0 (core)" in out and "ST" in out and "v0" in out  # core's roles over time: S then T
    assert "0.410" in out and "0.500" in out and "0:21 1:13" in out  # reward, held-out, claims
    assert "sampling→training" in out


def test_a_running_run_renders_as_running(tmp_path: Path) -> None:
    rd = recorded_run(tmp_path, finished=False)
    proc = gyre("status", str(rd.path), "--once", env=WIDE)
    assert proc.returncode == 0, proc.stderr
    assert "run: running · step 1/2" in proc.stdout
