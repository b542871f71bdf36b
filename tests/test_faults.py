"""Faults injected into real runs: every failure ends the run within a bound, names what failed,
and leaves nothing half written or running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, gyre, missing
from test_local_run import FAST, ROOT_OK, SMOKE, processes_of, wait_for

from gyre_hpc.agents.journal import Journal
from gyre_hpc.observability import events as ev
from gyre_hpc.proxy.run_shard import shard_of
from gyre_hpc.rundir import RunDir
from gyre_hpc.trajectory.codec import by_run, read_records
from gyre_hpc.trajectory.records import TitoRecord
from gyre_hpc.trajectory.tree import TrajectoryTree

pytestmark = pytest.mark.mpi


def step_1_finished(run: RunDir) -> int:
    """Step 1's executions that ended (the held-out evaluation before it has its own run ids)."""
    return sum(isinstance(e, ev.Finished) and e.run.startswith("s0001-") for e in events_of(run))


def start(runs_dir: Path, *sets: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "gyre_hpc", "run", SMOKE, "--set", f"run.runs_dir={runs_dir}"]
    for s in (*FAST, *sets):
        args += ["--set", s]
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **ROOT_OK, **(env or {})},
    )


def the_run(runs_dir: Path) -> RunDir:
    wait_for(lambda: any(runs_dir.iterdir()), 60, "the run directory")
    return RunDir(next(runs_dir.iterdir()))


def events_of(run: RunDir) -> list[ev.Event]:
    try:
        return run.read_events()
    except OSError:
        return []


@pytest.fixture
def small_disk(tmp_path: Path):  # noqa: ANN201
    """A 64 MB file system of its own (tmpfs), so that filling it harms nothing else."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True
    ).returncode:
        missing("root", "cannot mount a tmpfs here (root needed)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.root
def test_a_full_disk_ends_the_run_within_a_bound_and_says_why(small_disk: Path) -> None:
    proc = start(small_disk, "run.steps=3")
    run = the_run(small_disk)
    # Fill the disk once step 1's executions have all ended: the core's checkpoint, the event
    # log and the rank's own log all fail to write from then on.
    wait_for(lambda: step_1_finished(run) >= 32, 240, "step 1's executions")
    with (small_disk / "filler").open("wb") as fh:
        try:
            while True:
                fh.write(b"\0" * (1 << 20))
                fh.flush()
        except OSError:
            pass
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    # The failing rank aborts the world at once: well before cells.heartbeat_timeout_s (60 s).
    assert proc.returncode == 1 and time.monotonic() - started < 45
    # Whichever rank writes first fails first (the controller's event log, a rank's log or a
    # checkpoint); each names the disk.
    assert "run failed: rank " in err and "no space left on device under " in err, err[-2000:]
    assert str(small_disk) in err.split("no space left on device under ")[1], err[-2000:]
    assert not list(run.checkpoints.glob(".tmp-*"))  # a checkpoint is whole or absent
    assert processes_of(run) == []


def test_a_hung_cell_is_reported_lost_and_the_run_ends_within_a_bound(tmp_path: Path) -> None:
    proc = start(tmp_path, "run.steps=100", "cells.heartbeat_timeout_s=5")
    run = the_run(tmp_path)
    wait_for(lambda: any(isinstance(e, ev.Finished) for e in events_of(run)), 240, "an execution to end")
    cell = next(r for r in run.read_ranks() if r["rank"] == 2)
    os.kill(cell["pid"], signal.SIGSTOP)  # alive, but silent
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        try:
            os.kill(cell["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 1 and time.monotonic() - started < 60  # 5 s of silence, then a bounded stop
    failed = [e for e in run.read_events() if isinstance(e, ev.RankFailed)]
    assert failed and failed[0].error.startswith("CellLost: cell 1 (rank 2"), failed  # the first error told
    assert "CellLost: cell 1 (rank 2" in err


def test_a_core_whose_apply_outlasts_the_heartbeat_timeout_is_not_lost(tmp_path: Path) -> None:
    """The core's apply and checkpoint take twice ``cells.heartbeat_timeout_s`` (a large model's
    gradients summed and its optimizer stepped, emulated): it beats while it works, so the step
    completes instead of the core being declared lost."""
    proc = gyre(
        "run", str(REPO / "recipes" / "emulated.toml"), "--set", f"run.runs_dir={tmp_path}",
        "--set", "cells.count=2", "--set", "run.steps=1", "--set", "tasks.prompts_per_step=2",
        "--set", "trainer.emulated_apply_s=4", "--set", "cells.heartbeat_timeout_s=2",
        "--set", "trainer.checkpoint_every=1", "--set", "engine.emulated_tokens_median=20",
        timeout=300, env={**os.environ, **ROOT_OK},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (step,) = [e for e in RunDir(next(tmp_path.iterdir())).read_events() if isinstance(e, ev.Step)]
    assert step.apply_seconds >= 4


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def records_by_run(run: RunDir) -> dict[str, list[TitoRecord]]:
    encoded = [r for segment in run.tito_segments() for r in read_records(segment).records]  # one log
    trees = {r: TrajectoryTree.from_encoded(recs) for r, recs in by_run(encoded)}
    return {r: list(t.records()) for r, t in trees.items()}


def assert_continues(journalled: list[TitoRecord], nxt: TitoRecord) -> None:
    """``nxt``, the first call of a continued execution, carries on its journalled main context:
    it extends the last main call's context (through its tool results, and past any sub-agent it
    delegated to), or, when that call compacted the context (a ``main-summary`` is the last call
    journalled), it is the compacted context: the first call's [system, spec] and the summary. An
    execution begun again would repeat its first call's input."""
    main = [c for c in journalled if c.role == "main"]
    assert nxt.role == "main", nxt.role
    first = main[0].input_ids
    if journalled[-1].role == "main-summary":  # [system, spec] shared, then the summary, not the spec's end
        n = min(len(first), len(nxt.input_ids))
        shared = int(np.flatnonzero(np.append(nxt.input_ids[:n] != first[:n], True))[0])
        assert len(first) // 2 < shared < len(first) < len(nxt.input_ids), (shared, len(first), nxt.run_id)
    else:
        context = np.concatenate([main[-1].input_ids, main[-1].output_ids])
        assert np.array_equal(nxt.input_ids[: len(context)], context), nxt.run_id


@pytest.mark.timeout(900)  # a run killed mid-step and resumed, on however loaded a machine
@pytest.mark.parametrize(("executors", "workers"), [(2, 2)])
def test_a_restart_continues_the_steps_executions_from_their_last_call(
    tmp_path: Path, executors: int, workers: int
) -> None:
    """With executor processes, the executions ran on them and run there again; with proxy
    workers, each run's calls are in its worker's TITO segment, cut and continued alike. Without
    executors the same Dispatcher, harness and journal run on the controller (``runtime.serving``
    hands them the step's journal as a node does), and a restarted world continues the step under
    way there (``test_a_rank_that_dies_is_restarted_by_itself``)."""
    sets = ["run.steps=1", "agent.max_calls=6", "tasks.prompts_per_step=4"]
    sets += [f"executors.nodes={executors}", f"proxy.workers={workers}"]
    proc = start(tmp_path, *sets)
    run = the_run(tmp_path)
    # Over half of step 1's 16 executions have ended and one is under way: the controller's rank dies
    # (mpirun ends the rest). The executors are frozen while the journal is read, so the moment
    # is the one read however loaded the machine is (the rest might end before a kill otherwise).
    frozen: list[int] = []

    def frozen_at_the_moment() -> bool:
        frozen[:] = [p for p in processes_of(run) if b"gyre_hpc.executors" in cmdline(p)]
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        journal = Journal(run.journal(1))
        entries = [e for r in journal.run_ids() if (e := journal.load(r)) is not None]
        ended = sum(e.finished for e in entries)
        if ended >= 10 and any(not e.finished and e.calls for e in entries):
            return True
        if proc.poll() is not None:  # the run ended by itself: say why
            raise AssertionError(f"the run ended (exit {proc.returncode}): {proc.communicate()[1][-3000:]}")
        assert ended < 16, f"the moment passed: {ended} ended"
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        return False

    wait_for(frozen_at_the_moment, 600, "10 executions ended and one under way")
    os.kill(next(r["pid"] for r in run.read_ranks() if r["rank"] == 0), signal.SIGKILL)
    assert proc.wait(timeout=120) == 1
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # what was sent them meanwhile ends them now
    wait_for(lambda: processes_of(run) == [], 60, "every rank to stop")
    journal = Journal(run.journal(1))
    before = {r: journal.load(r) for r in journal.run_ids()}
    finished = {r for r, e in before.items() if e is not None and e.finished}
    running = {r: e.calls for r, e in before.items() if e is not None and not e.finished and e.calls}
    assert len(finished) >= 10 and running, (len(finished), running)
    calls_before = records_by_run(run)

    resumed = gyre("run", "--resume", str(run.path))

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    point = next(e for e in run.read_events() if isinstance(e, ev.Resumed))
    assert (point.step, point.kept_finished, point.continued) == (1, len(finished), len(running))
    after = records_by_run(run)
    for r in finished:  # not run again: not one call more
        assert after[r] == calls_before[r]
    for r, calls in running.items():  # the journalled calls stay, and the next one continues them
        assert after[r][:calls] == calls_before[r][:calls]
        if len(after[r]) > calls:
            assert_continues(after[r][:calls], after[r][calls])
    assert any(len(after[r]) > calls for r, calls in running.items())  # some did call again
    step = next(e for e in run.read_events() if isinstance(e, ev.Step))
    assert step.executions == 16
    placed = [e for e in run.read_events() if isinstance(e, ev.Placed)]
    assert {e.node for e in placed} == {f"local-{i + 1}" for i in range(executors)}
    assert len(run.tito_segments()) == workers
    for n, segment in enumerate(run.tito_segments()):  # each run's calls in its own worker's segment
        runs = {r.run_id for r in read_records(segment).records}
        assert runs and all(shard_of(r, workers) == n for r in runs)


FAULTS = ("push@2", "proxy@1", "apply@1", "publish@1", "checkpoint@1", "record@0", "emit@0")
"""A step's deterministic fault points, in the order a run reaches them (``faults.points``):
cell 1's leader as it loads its first version, proxy worker 1 once the first call it serves is
answered by its engine (before it is recorded), the core (cell 0's leader) as it applies the step,
once it published the new version, midway through the step's checkpoint, the controller as it
writes the step's record, and once it marked the checkpoint, before the record is in the log."""


@pytest.mark.timeout(900)  # two runs, one of them restarted seven times
def test_a_fault_at_each_point_of_a_step_costs_a_restart_and_loses_nothing(tmp_path: Path) -> None:
    """One step, and a rank killed at each point in turn: every fault costs one restart of the
    world; the step is recorded once, the executions that finished before a fault are kept (none
    runs again), no model call is recorded twice, and the checkpoint the controller died before
    recording is passed over (its step runs again, from the journal); one it marked but died
    before logging the record of counts, and its record is written by the next world. The run is
    seeded: every call samples what the same run without a fault samples, so every execution gets
    the same reward."""
    sets = ("run.steps=1", "trainer.checkpoint_every=1", "proxy.workers=2", "run.model=tiny-warm")
    # Side by side: the plain run computes while the faulted one waits on its restarts.
    plain = start(tmp_path / "plain", *sets)
    proc = start(tmp_path / "faulted", *sets, "run.max_restarts=7", env={"GYRE_FAULT": ",".join(FAULTS)})
    _, said = plain.communicate(timeout=600)
    assert plain.returncode == 0, said[-3000:]
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    run = the_run(tmp_path / "faulted")
    events = run.read_events()
    assert sorted(p.name for p in run.fault_markers.iterdir()) == sorted(FAULTS)  # each happened once
    assert [e.attempt for e in events if isinstance(e, ev.WorldUp)] == [1, 2, 3, 4, 5, 6, 7, 8]
    proxy_died = [e for e in events if isinstance(e, ev.Restarting)][1]
    assert "proxy worker 1 died (exit -9)" in proxy_died.reason, proxy_died
    assert [e.step for e in events if isinstance(e, ev.Step)] == [1]
    step = next(e for e in events if isinstance(e, ev.Step))
    resumed = [e for e in events if isinstance(e, ev.Resumed)]
    assert [e.kept_finished for e in resumed[2:-1]] == [step.executions] * 4  # after the step's burst
    assert any("never recorded" in s for s in resumed[-2].skipped), resumed[-2]
    assert resumed[-1].step == 2 and not resumed[-1].skipped  # the marked step counts: not run again
    last_world = [e for e in events if isinstance(e, ev.WorldUp)][-1]
    assert events.index(step) > events.index(last_world)  # its record, written by the last world
    for run_id, records in records_by_run(run).items():
        calls = [r.call_id for r in records]
        assert len(calls) == len(set(calls)), run_id
    assert [e.status for e in events if isinstance(e, ev.RunEnd)] == ["completed"]
    unfaulted = the_run(tmp_path / "plain")
    sampled = {r: [c.output_ids.tolist() for c in cs] for r, cs in records_by_run(run).items()}
    assert sampled == {r: [c.output_ids.tolist() for c in cs] for r, cs in records_by_run(unfaulted).items()}
    (same,) = [e for e in unfaulted.read_events() if isinstance(e, ev.Step)]
    assert 0 < step.reward_mean < 1 and (step.reward_mean, step.pass_rate, step.groups) == (
        same.reward_mean, same.pass_rate, same.groups)  # fmt: skip


def test_a_rank_that_dies_is_restarted_by_itself(tmp_path: Path) -> None:
    proc = start(tmp_path, "run.steps=2", "run.max_restarts=1", "trainer.checkpoint_every=1")
    run = the_run(tmp_path)
    wait_for(lambda: any(isinstance(e, ev.Step) for e in events_of(run)), 240, "a step")
    os.kill(next(r["pid"] for r in run.read_ranks() if r["rank"] == 2), signal.SIGKILL)  # a lost node
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "restarting (attempt 2)" in err and "rank 2 (cell 1" in err
    events = run.read_events()
    assert [e.attempt for e in events if isinstance(e, ev.WorldUp)] == [1, 2]
    restart = next(e for e in events if isinstance(e, ev.Restarting))
    assert restart.reason.startswith("rank 2 (cell 1 on"), restart
    resumed = next(e for e in events if isinstance(e, ev.Resumed))
    steps = [e.step for e in events if isinstance(e, ev.Step)]
    assert steps[-1] == 2 and resumed.step == steps[steps.index(resumed.step - 1) + 1]
    assert [e.status for e in events if isinstance(e, ev.RunEnd)] == ["completed"]
    # A resume's overrides kept apart from the recipe as created: launch.start.open_run, the same
    # for run and submit (tests/test_slurm_faults.py resumes a job that way).
