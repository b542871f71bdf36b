"""`gyre-hpc status --once` renders a frame from a run directory alone (finished or running)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import gyre

from gyre_hpc.observability import events as ev
from gyre_hpc.recipe import load_recipe
from gyre_hpc.rundir import RunDir

T0 = 1_800_000_000.0
WIDE = {**os.environ, "COLUMNS": "160"}


def recorded_run(tmp_path: Path, finished: bool) -> RunDir:
    rd = RunDir.create(tmp_path, "rec")
    rd.write_recipe(load_recipe(Path("recipes/smoke.toml"), ["run.steps=2", "cells.count=3"]))
    events: list[ev.Event] = [
        ev.RunStart(launcher="mpirun"),
        *(
            ev.Hello(cell=c, rank=c + 1, host="n1", pid=100 + c, addresses=(f"http://n1:{c}",), capacity=8)
            for c in range(3)
        ),
        *(ev.RoleSwitched(cell=c, role="sampling", seq=c, seconds=0.01) for c in range(3)),
        ev.WeightsLoaded(version=0, units=[0, 1, 2], seconds=0.01),
        ev.WeightsLoaded(
            version=1, units=[1, 2], seconds=0.04, bytes=150_000, whole_bytes=3_600_000, changed=0.0125
        ),
        ev.Dispatched(run="r1", d=32, p=32, f=0),
        ev.EngineRestart(cell=2, cause="died during load", attempts=2, seconds=21.5, version=1),
        ev.Finished(run="r1", d=32, p=32, f=20),
        ev.RoleSwitched(cell=0, role="training", seq=4, seconds=0.05),
        ev.Switch(step=1, cell=0, direction="sampling→training", reason="w", seconds=0.1),
        ev.Step(
            step=1,
            version=1,
            seconds=11.0,
            sample_seconds=9.5,
            roles={"0": "training", "1": "sampling", "2": "sampling"},
            reward_mean=0.41,
            pass_rate=0.40,
            micro_steps=34,
            claims={"0": 21, "1": 13},
            engine_calls={"http://n1:1": 40, "http://n1:2": 35},
        ),
        ev.Eval(step=1, version=1, n=32, statuses={"finished": 32}, pass_rate=0.5, mean_score=0.5),
    ]
    if finished:
        events.append(ev.RunEnd(status="completed"))
    with rd.events.open("w") as fh:  # the schema as written on disk
        for i, e in enumerate(events):
            fh.write(json.dumps({"t": T0 + i, "event": e.kind, **e.fields()}) + "\n")
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
    assert "engine restarts: 1 (last: cell 2, died during load, 2 start(s), 21.5 s, back at version 1)" in out
    assert "last load: v1 into cells 1 2 · 0.1 MB sent of 3.6 MB whole · 1.2% changed" in out
    rows = [line for line in out.splitlines() if line.startswith("│ http://n1:")]
    engines = {line.split("│")[1].strip(): line for line in rows}
    assert engines.keys() == {"http://n1:0", "http://n1:1", "http://n1:2"}
    assert engines["http://n1:1"].replace(" ", "").endswith("│1│40│40│")  # cell, last step, all


def test_a_running_run_renders_as_running(tmp_path: Path) -> None:
    rd = recorded_run(tmp_path, finished=False)
    proc = gyre("status", str(rd.path), "--once", env=WIDE)
    assert proc.returncode == 0, proc.stderr
    assert "run: running · step 1/2" in proc.stdout


def test_a_job_nobody_knows_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = gyre("status", "987654321", "--once", "--runs-dir", str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"error: job 987654321: Slurm knows no such job (neither queued nor in accounting) and no run "
        f"directory in {tmp_path}/ names it"
    ]
