"""``gyre-hpc traj show``: a run directory's trees, readable and as JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import gyre

from gyre_hpc.rundir import RunDir
from gyre_hpc.trajectory import TitoRecord, TrajectoryTree
from gyre_hpc.trajectory.codec import write_records


def make_run_dir(tmp_path: Path) -> RunDir:
    rd = RunDir.create(tmp_path, "t")
    records = []
    ctx = [1, 2, 10]
    for turn in range(40):  # a long linear main chain: must collapse to one line
        out = [100 + turn, 101 + turn]
        records.append(TitoRecord("run-a", f"m{turn}", "main", ctx, out, [-0.5, -0.5]))
        ctx = ctx + out + [50]
    records.append(TitoRecord("run-a", "s", "main-summary", ctx + [11], [900], [-1.0]))
    records.append(TitoRecord("run-a", "sub", "sub-agent", [3, 4], [110], [-1.0]))
    records.append(TitoRecord("run-a", "subs", "sub-agent-summary", [3, 4, 110, 21], [111], [-1.0]))
    records.append(TitoRecord("run-b", "x", "main", [1, 2], [7], [-1.0]))
    trees = {"run-a": TrajectoryTree("run-a"), "run-b": TrajectoryTree("run-b")}
    write_records(rd.tito_log, [trees[r.run_id].add(r) for r in records])
    return rd


def test_show_collapses_chains_and_marks_roles_and_selection(tmp_path: Path) -> None:
    rd = make_run_dir(tmp_path)
    proc = gyre("traj", "show", str(rd.path), "--run", "run-a", env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "run-a · 43 calls" in out and "run-b" not in out
    assert "main ×40, main-summary ×1 · leaf main-summary · selected #1" in out
    assert "leaf sub-agent-summary" in out
    assert len(out.splitlines()) < 12  # 43 calls, a handful of lines


def test_show_json(tmp_path: Path) -> None:
    rd = make_run_dir(tmp_path)
    proc = gyre("traj", "show", str(rd.path), "--json")
    runs = {r["run"]: r for r in json.loads(proc.stdout)}
    assert runs["run-a"]["calls"] == 43 and runs["run-b"]["calls"] == 1
    (main_seg, sub_seg) = runs["run-a"]["segments"]
    assert main_seg["calls"] == {"main": 40, "main-summary": 1}
    assert main_seg["leaf_role"] == "main-summary" and main_seg["selected"][0]["order"] == 1
    assert sub_seg["calls"] == {"sub-agent": 1, "sub-agent-summary": 1}


def test_show_errors_are_one_line(tmp_path: Path) -> None:
    proc = gyre("traj", "show", str(tmp_path))
    assert proc.returncode == 2 and "has no TITO log" in proc.stderr and "Traceback" not in proc.stderr
    rd = make_run_dir(tmp_path)
    proc = gyre("traj", "show", str(rd.path), "--run", "nope")
    assert proc.returncode == 2 and "no run 'nope'" in proc.stderr
