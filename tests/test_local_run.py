"""``gyre-hpc run``: real MPI ranks under mpirun on this machine, end to end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import COLOCATE, NO_EVAL, REPO, ROOT_OK, SMOKE, gyre

from gyre_hpc.observability.events import read_events
from gyre_hpc.recipe import load_recipe
from gyre_hpc.rundir import RunDir

pytestmark = pytest.mark.mpi
# The world, not learning, is under test here: the untrained tiny model is built in seconds.
FAST = ["run.model=tiny", "agent.max_calls=2", NO_EVAL]


def only_run(runs: Path) -> RunDir:
    (path,) = runs.iterdir()
    return RunDir(path)


def kinds(run: RunDir) -> list[str]:
    return [e.kind for e in read_events(run.events)]


def processes_of(run: RunDir) -> list[int]:
    """Live processes whose command line names this run directory (mpirun and every rank)."""
    needle = str(run.path).encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and needle in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_smoke_run_brings_up_the_world_and_exits_0(colocate_run: Path) -> None:
    """The smoke recipe as shipped, 3 steps (the session's colocate run, ``conftest.COLOCATE``)."""
    run = RunDir(colocate_run)
    events = read_events(run.events)
    world = next(e for e in events if e.kind == "world_up")
    assert (world.size, world.launcher) == (3, "mpirun")
    assert sorted(e.cell for e in events if e.kind == "hello") == [0, 1]
    first_roles = [(e.cell, e.role) for e in events if e.kind == "role_switched"][:2]
    assert sorted(first_roles) == [(0, "sampling"), (1, "sampling")]  # colocate starts sampling
    assert [e.step for e in events if e.kind == "step"] == [1, 2, 3]
    assert kinds(run)[-2:] == ["shutdown", "run_end"] and events[-1].status == "completed"
    assert [r["rank"] for r in run.read_ranks()] == [0, 1, 2]
    sets = [f"run.runs_dir={colocate_run.parent}", *COLOCATE]
    assert load_recipe(run.recipe_path) == load_recipe(SMOKE, sets)
    assert processes_of(run) == []


def test_multi_rank_cells_pool_and_async_roles(tmp_path: Path) -> None:
    """Cells of 2 ranks, a rollout pool, async: the world's shape, every replica serving, the
    fixed split and its one-version staleness (the warm-started model: steps that train)."""
    sets = [f"run.runs_dir={tmp_path}", "cells.ranks_per_cell=2", "cells.rollout_pool=1"]
    sets += ["scheduler.mode=async", "run.steps=3", NO_EVAL]
    sets += ["tasks.prompts_per_step=4"]  # 16 executions: every engine serves
    proc = gyre("run", SMOKE, *(a for s in sets for a in ("--set", s)), timeout=600)
    assert proc.returncode == 0, proc.stderr
    run = only_run(tmp_path)
    events = read_events(run.events)
    assert next(e for e in events if e.kind == "world_up").size == 6
    hellos = {e.cell: (e.rank, e.standalone) for e in events if e.kind == "hello"}
    assert hellos == {0: (1, False), 1: (3, False), 2: (5, True)}  # leaders only
    # Two engine replicas a cell (one per rank: engine.tp_size = 1), one for the pool's engine.
    replicas = {e.cell: len(e.addresses) for e in events if e.kind == "hello"}
    assert replicas == {0: 2, 1: 2, 2: 1}
    steps = [e for e in events if e.kind == "step"]
    assert [e.step for e in steps] == [1, 2, 3]
    for step in steps:
        assert len(step.engine_calls) >= 2 and sum(step.engine_calls.values()) == step.calls
        assert step.skipped or step.claims == {"0": step.micro_steps}  # the split's trainer alone
    switched = {e.cell: e.role for e in events if e.kind == "role_switched"}
    assert switched == {0: "training", 1: "sampling", 2: "sampling"}  # set once, never changed
    assert len([e for e in events if e.kind == "role_switched"]) == 3
    # Later steps train on calls served one version behind, never more.
    stale = {k for e in steps for k, n in e.staleness.items() if n}
    assert "1" in stale and stale <= {"0", "1"}
    # The first load goes to the engines that serve, not into a training cell's released memory.
    assert next(e for e in events if e.kind == "weights_loaded").units == [1, 2]
    assert sorted((r["rank"], r["cell"]) for r in run.read_ranks()) == [
        (0, None),
        (1, 0),
        (2, 0),
        (3, 1),
        (4, 1),
        (5, 2),
    ]


def start_long_run(tmp_path: Path) -> tuple[subprocess.Popen[str], RunDir]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gyre_hpc",
            "run",
            SMOKE,
            "--set",
            f"run.runs_dir={tmp_path}",
            "--set",
            "run.steps=100000",
            *(a for s in FAST for a in ("--set", s)),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: any(tmp_path.iterdir()), 30, "the run directory")
    run = only_run(tmp_path)
    wait_for(lambda: "finished" in kinds(run), 60, "the first execution to end")  # the world works
    return proc, run


def test_killing_a_cell_rank_fails_the_run_cleanly(tmp_path: Path) -> None:
    proc, run = start_long_run(tmp_path)
    cell_rank = next(r for r in run.read_ranks() if r["rank"] == 2)
    os.kill(cell_rank["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "run failed: rank 2 (cell 1 on " in err and "exited on signal 9" in err
    end = read_events(run.events)[-1]
    assert (end.kind, end.status) == ("run_end", "failed")
    assert processes_of(run) == []


def test_ctrl_c_stops_every_rank_and_is_recorded(tmp_path: Path) -> None:
    """Ctrl-C end to end; SIGTERM (scancel, a terminal closed) takes the same path
    (``test_the_launcher_treats_sigterm_as_ctrl_c``)."""
    proc, run = start_long_run(tmp_path)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - started < 10
    assert proc.returncode == 130 and "run interrupted" in err
    end = read_events(run.events)[-1]
    assert (end.kind, end.status) == ("run_end", "interrupted")
    assert processes_of(run) == []


@pytest.mark.parametrize(
    ("launcher_env", "message"),
    [
        ({}, "MPI world has 1 rank but the recipe needs 3 (1 controller + 2 cells × 1 ranks)"),
        (
            {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "3"},
            "MPI world has 1 rank but slurm started 3 tasks — srun's --mpi plugin does not match",
        ),
    ],
)
def test_wrong_world_size_is_an_error_not_a_hang(
    tmp_path: Path, launcher_env: dict[str, str], message: str
) -> None:
    """A rank started alone (or by srun with the wrong --mpi plugin) sees a size-1 world."""
    run = RunDir.create(tmp_path, "alone")
    run.write_recipe(load_recipe(SMOKE))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "SLURM_", "PMI"))}
    proc = subprocess.run(
        [sys.executable, "-m", "gyre_hpc.runtime", str(run.path)],
        capture_output=True,
        text=True,
        env={**env, **ROOT_OK, **launcher_env},
        timeout=60,
    )
    assert proc.returncode != 0
    assert message in proc.stderr
    failed = [e for e in read_events(run.events) if e.kind == "rank_failed"]
    assert len(failed) == 1 and message in failed[0].error


def test_a_backend_missing_here_is_refused_in_one_line(tmp_path: Path) -> None:
    proc = gyre("run", str(REPO / "recipes" / "qwen3-8b-8cells.toml"), "--set", f"run.runs_dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: engine.backend = 'sglang' needs SGLang beside gyre-hpc in this environment (each cell "
        "starts `python -m sglang.launch_server` with this interpreter); here: bash tools/setup.sh "
        "--sglang, then run .venv-sglang/bin/gyre-hpc"
    ]
    assert not any(tmp_path.iterdir())  # refused before a run directory was made


def test_the_launcher_treats_sigterm_as_ctrl_c() -> None:
    """While a world runs the launcher routes SIGINT and SIGTERM to the one interrupt (every rank
    stopped, then killed after the grace), and SIGUSR2 to the ranks' checkpoint."""
    from gyre_hpc.launch.local import _restore_signals, _trap_signals

    got: list[str] = []
    previous = _trap_signals(lambda: got.append("interrupt"), on_usr2=lambda: got.append("usr2"))
    try:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2):
            os.kill(os.getpid(), signum)  # delivered to this (the main) thread before kill returns
    finally:
        _restore_signals(previous)
    assert got == ["interrupt", "interrupt", "usr2"]


def test_leaving_runs_what_the_way_out_needs_and_skips_the_teardown(tmp_path: Path) -> None:
    """``launch.leave``: a thread still working is waited for, atexit hooks run, MPI (initialised
    here) is finalized (mpirun counts a rank that skipped it as failed), unflushed output is
    written, and the code is the process's."""
    program = tmp_path / "leaving.py"
    program.write_text(
        "import atexit, sys, threading, time\n"
        "from mpi4py import MPI\n"
        "from gyre_hpc.launch.leave import leave\n"
        f"out = {str(tmp_path)!r}\n"
        "atexit.register(lambda: open(out + '/atexit', 'w').write(str(MPI.Is_finalized())))\n"
        "late = lambda: (time.sleep(0.2), open(out + '/thread', 'w').write('done'))\n"
        "threading.Thread(target=late).start()\n"
        "sys.stdout.write('no newline, not flushed')\n"
        "leave(3)\n"
    )
    proc = subprocess.run(
        ["mpirun", "--oversubscribe", "-n", "1", sys.executable, str(program)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"},
    )  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no newline, not flushed" in proc.stdout
    assert "exiting improperly" not in proc.stdout + proc.stderr  # finalized before the end
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "False"  # the hooks ran first, MPI still up
