"""How a run ended, in one line that names the failing rank."""

from __future__ import annotations

from pathlib import Path

from gyre_hpc.launch.outcome import conclude, diagnose
from gyre_hpc.observability import events as ev
from gyre_hpc.rundir import RunDir


def test_rank_failure_event_names_rank_and_cell(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path, "t")
    with ev.EventLog(run.events) as log:
        log.emit(ev.RankFailed(rank=2, task=2, cell=1, host="node3", error="ProtocolError: no Hello"))
    out = diagnose(run, 1, False, None)
    assert out == ev.RunEnd(
        status="failed", returncode=1, reason="rank 2 (cell 1 on node3) failed: ProtocolError: no Hello"
    )


def test_killed_rank_found_in_mpirun_log(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path, "t")
    run.write_rank(1, pid=99, host="vm", kind="cell", cell=0)
    log = run.logs / "mpirun.log"
    log.write_text(
        "----\nmpirun noticed that process rank 1 with PID 99 on node vm exited on signal 9 (Killed).\n"
    )
    reason = diagnose(run, 137, False, log).reason
    assert reason == "rank 1 (cell 0) died: process rank 1 with PID 99 on node vm exited on signal 9 (Killed)"


def test_srun_task_death(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path, "t")
    log = run.logs / "slurm.out"
    log.write_text("srun: error: node2: task 1: Killed\n")
    assert diagnose(run, 137, False, log).reason == "a rank died: node2: task 1: Killed"


def test_interrupted_and_completed_are_recorded(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path, "t")
    assert conclude(run, 143, True, None).status == "interrupted"
    assert conclude(run, 0, False, None).status == "completed"
    assert [e.status for e in run.read_events() if isinstance(e, ev.RunEnd)] == ["interrupted", "completed"]
