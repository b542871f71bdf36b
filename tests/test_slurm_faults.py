"""Faults in a job on the real (local) Slurm: a time-limit warning checkpoints and requeues the job,
a killed cell is named by its global rank, cell and node."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import COLOCATE, gyre
from test_local_run import wait_for
from test_slurm_job import submit, wait_for_event

from gyre_hpc.launch.slurm import job_state
from gyre_hpc.observability import events as ev
from gyre_hpc.rundir import RunDir

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]


def ends(run: RunDir) -> list[ev.RunEnd]:
    return [e for e in run.read_events() if isinstance(e, ev.RunEnd)]


def test_sigusr2_checkpoints_requeues_and_the_job_completes_as_a_straight_run(
    tmp_path: Path, colocate_run: Path
) -> None:
    """The straight run is the session's colocate run (``conftest.COLOCATE``, the recipe as
    shipped otherwise): the job runs the same recipe, but for the run directory."""
    sets = [*COLOCATE, "run.model=tiny-warm", "agent.max_calls=6"]  # submit's own defaults undone
    job_id, run = submit(tmp_path / "slurm", *sets)
    wait_for_event(run, "step", timeout=180)
    # What --signal=B:USR2@grace does near the time limit: the batch shell alone is signalled.
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], check=True)
    preempted = wait_for_event(run, "preempted", timeout=180)
    assert (run.checkpoints / f"step-{preempted.step:06d}").is_dir()  # checkpointed off schedule
    wait_for_event_count(run, ev.RunEnd, 1, timeout=120)
    wait_for(lambda: job_state(job_id).state == "PENDING", 60, "the requeued job")
    requeued = int(time.time())  # its last attempt's credential was revoked by now
    status = gyre("status", str(run.path), "--once")
    assert "run: requeued · attempt 1 · step 2/3" in status.stdout, status.stdout
    # Slurm holds a requeued job ~2 minutes before it may start again; the test lets it start
    # now, in a later second than the requeue: a node refuses a job whose credential is as old as
    # (the same second as) the revocation of its last attempt's ("Job credential revoked"), and
    # the job ends FAILED. Now, not in a moment: a het job given a start time still to come
    # waited 3 to 160 s more for the backfill to take it (measured); one that may start now, 1 s.
    wait_for(lambda: int(time.time()) > requeued, 5, "the next second")
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    wait_for_event_count(run, ev.RunEnd, 2, timeout=300)
    first, last = ends(run)
    assert first.status == "preempted" and last.status == "completed", (first, last)
    events = run.read_events()
    assert [e.attempt for e in events if isinstance(e, ev.WorldUp)] == [1, 2]
    resumed = next(e for e in events if isinstance(e, ev.Resumed))
    assert resumed.step == preempted.step + 1
    out = (run.logs / "slurm.out").read_text()
    assert "run preempted" in out and "requeued" in out and "run completed" in out  # both attempts
    steps = {e.step: e.reward_mean for e in events if isinstance(e, ev.Step)}
    local = RunDir(colocate_run)
    assert steps == {e.step: e.reward_mean for e in local.read_events() if isinstance(e, ev.Step)}
    status = gyre("status", str(run.path), "--once")
    assert "run: completed · attempt 2 · step 3/3" in status.stdout, status.stdout


def wait_for_event_count(run: RunDir, kind: type, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while sum(isinstance(e, kind) for e in run.read_events()) < n:
        assert time.monotonic() < deadline, (run.logs / "slurm.out").read_text()[-3000:]
        time.sleep(0.25)


def test_a_killed_cell_is_named_the_world_restarts_and_submit_resume_continues_until_cancelled(
    tmp_path: Path,
) -> None:
    job_id, run = submit(tmp_path, "run.steps=2", "run.max_restarts=1", "trainer.checkpoint_every=1")
    wait_for_event(run, "step", timeout=180)
    cell1 = next(r for r in run.read_ranks() if r["rank"] == 2)
    os.kill(cell1["pid"], signal.SIGKILL)  # every emulated node is a process on this host
    restart = wait_for_event(run, "restarting", timeout=120)
    # srun says "node3: task 1": the cells component's second task, global rank 2.
    assert restart.reason.startswith(f"rank 2 (cell 1 on {cell1['host']}) died"), restart.reason
    end = wait_for_event(run, "run_end", timeout=300)
    assert end.status == "completed", end
    events = run.read_events()
    assert [e.attempt for e in events if isinstance(e, ev.WorldUp)] == [1, 2]
    assert [e.step for e in events if isinstance(e, ev.Step)][-1] == 2

    created = run.recipe_path.read_text()
    more = gyre("submit", "--resume", str(run.path), "--set", "run.steps=100000")
    assert more.returncode == 0, more.stderr
    assert run.recipe_path.read_text() == created  # the recipe as created stays; the resume's apart
    assert run.overrides() == ["run.steps=100000"] and run.read_recipe().run.steps == 100000
    again = run.read_job()["job_id"]
    assert again != job_id
    wait_for(lambda: 3 in [e.step for e in run.read_events() if isinstance(e, ev.Step)], 300, "step 3")
    # A job under way is cancelled by its run directory: interrupted, recorded, and Slurm says so.
    cancelled = gyre("cancel", str(run.path))
    assert cancelled.returncode == 0 and f"cancelled job {again}" in cancelled.stdout
    wait_for_event_count(run, ev.RunEnd, 2, timeout=120)
    assert ends(run)[-1].status == "interrupted"
    wait_for(lambda: job_state(again).state == "CANCELLED", 60, "the cancelled job's state")
