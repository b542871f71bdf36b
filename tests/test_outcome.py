"""How a run ended, in one line that names the failing rank."""

from __future__ import annotations

from pathlib import Path

from gyre_hpc.launch.ending import conclude, diagnose
from gyre_hpc.observability import events as ev
from gyre_hpc.recipe import load_recipe
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
    assert (
        reason
        == "rank 1 (cell 0 on vm) died: process rank 1 with PID 99 on node vm exited on signal 9 (Killed)"
    )


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


def test_srun_numbers_tasks_per_het_component_and_the_right_cell_and_node_are_named(tmp_path: Path) -> None:
    """srun's "task 1" on node3 is the cells component's second task: global rank 2, cell 1 (the
    controller is component 0 on node1)."""
    run = RunDir.create(tmp_path, "t")
    run.write_recipe(load_recipe(None, ["cells.count=2"]))
    for rank, host, cell in ((0, "node1", None), (1, "node2", 0), (2, "node3", 1)):
        run.write_rank(
            rank, pid=100 + rank, host=host, kind="cell" if cell is not None else "controller", cell=cell
        )
    log = run.logs / "slurm.out"
    # The first death is the cause; srun then reports the ranks it stopped because of it.
    log.write_text("srun: error: node3: task 1: Killed\nsrun: error: node2: task 0: Killed\n")
    assert diagnose(run, 137, False, log).reason == "rank 2 (cell 1 on node3) died: node3: task 1: Killed"
    # slurm.out is appended across attempts: only the last attempt's lines count.
    with log.open("a") as fh:
        fh.write("gyre-hpc: restarting (attempt 2): …\nsrun: error: node2: task 0: Killed\n")
    assert diagnose(run, 137, False, log).reason.startswith("rank 1 (cell 0 on node2) died")


def test_a_rank_s_last_words_name_it_when_its_event_could_not_be_written(tmp_path: Path) -> None:
    """A full disk: no rank_failed event, no log; the launcher's in-memory output still tells."""
    run = RunDir.create(tmp_path, "t")
    run.write_rank(1, pid=99, host="vm", kind="cell", cell=0)
    output = "gyre-hpc: rank 1 failed: OSError: [Errno 28] No space left on device\n"
    reason = diagnose(run, 1, False, None, output).reason
    assert reason == "rank 1 (cell 0 on vm) failed: OSError: [Errno 28] No space left on device"
