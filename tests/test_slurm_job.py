"""``gyre-hpc submit``: the same world as ONE heterogeneous job on a real (local) Slurm."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import NO_EVAL, REPO, gyre

from gyre_hpc.launch.slurm import JobState, job_state
from gyre_hpc.observability.events import read_events
from gyre_hpc.rundir import RunDir

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]
SMOKE = str(REPO / "recipes" / "smoke.toml")


def submit(tmp_path: Path, *sets: str) -> tuple[str, RunDir]:
    args = ["submit", SMOKE, "--set", f"run.runs_dir={tmp_path}", "--set", "run.model=tiny"]
    args += ["--set", "agent.max_calls=2", "--set", "run.steps=3", "--set", NO_EVAL]
    for s in sets:
        args += ["--set", s]
    proc = gyre(*args)
    assert proc.returncode == 0, proc.stderr
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    run_dir = re.search(r"run directory: (\S+)", proc.stdout).group(1)
    return job_id, RunDir(Path(run_dir))


def wait_for_event(run: RunDir, kind: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in read_events(run.events) if e.kind == kind]
        if found:
            return found[-1]
        time.sleep(0.25)
    raise AssertionError(
        f"no {kind} event in {timeout} s; log: {(run.logs / 'slurm.out').read_text()[-2000:]}"
    )


def wait_for_state(job_id: str, expected: str, timeout: float = 60, components: int = 2) -> JobState:
    """Accounting lags the job by a second or so, and lists a het job's components late."""
    deadline = time.monotonic() + timeout
    while (state := job_state(job_id)).state != expected or len(state.components) < components:
        assert time.monotonic() < deadline, f"job {job_id} is {state}, expected {expected}"
        time.sleep(0.5)
    return state


@pytest.mark.megatron
def test_a_megatron_cell_spans_the_ranks_of_its_node(tmp_path: Path) -> None:
    """Each cell: 2 tensor-parallel ranks on one emulated node, meeting at their leader's host."""
    job_id, run = submit(
        tmp_path,
        *("trainer.backend=megatron", "trainer.tp_size=2", "cells.ranks_per_cell=2", "run.steps=2"),
        *(
            "run.model=tiny-warm",
            "agent.max_calls=6",
            "tasks.prompts_per_step=2",
            "run.seed=1",
        ),  # rewards that differ
    )
    end = wait_for_event(run, "run_end", timeout=240)
    assert end.status == "completed", end
    events = read_events(run.events)
    assert next(e for e in events if e.kind == "world_up").size == 5
    assert [e.version for e in events if e.kind == "step"] == [1, 2]
    hosts = {r["rank"]: r["host"] for r in run.read_ranks()}
    assert hosts[1] == hosts[2] != hosts[3] == hosts[4] != hosts[0]
    wait_for_state(job_id, "COMPLETED")


def test_submit_runs_one_het_world_whose_executor_nodes_run_the_executions_and_outlive_one_killed(
    tmp_path: Path,
) -> None:
    """A seeded colocate run, once with its executions on the controller (mpirun) and once as one
    het job (controller, cells, two executor nodes): one MPI world over its components' nodes, the
    same rewards; one executor is SIGKILLed mid-burst, and the job completes all the same."""
    same = [
        "run.model=tiny-warm",
        "agent.max_calls=6",
        "run.steps=2",
        NO_EVAL,
        "tasks.prompts_per_step=4",
    ]
    local = gyre(
        "run", SMOKE, *(a for s in [f"run.runs_dir={tmp_path / 'local'}", *same] for a in ("--set", s))
    )
    assert local.returncode == 0, local.stderr[-2000:]
    alone = [
        e for e in read_events(next((tmp_path / "local").iterdir()) / "events.jsonl") if e.kind == "step"
    ]
    job_id, run = submit(
        tmp_path / "slurm", *same,
        *("executors.nodes=2", "executors.cpus_per_node=1", "executors.lease_s=2", "proxy.host=0.0.0.0"),
    )  # fmt: skip
    first = wait_for_event(run, "step", timeout=240)
    # Step 2's burst is placed: the executor on node4 is killed while it runs its share.
    deadline = time.monotonic() + 120
    while not [e for e in read_events(run.events) if e.kind == "placed" and e.t > first.t]:
        assert time.monotonic() < deadline, "step 2 was never placed"
        time.sleep(0.1)
    up = {e.node: e for e in read_events(run.events) if e.kind == "executor_up"}
    os.kill(up["node4"].pid, signal.SIGKILL)
    end = wait_for_event(run, "run_end", timeout=240)
    assert end.status == "completed", end
    events = read_events(run.events)
    assert run.read_job()["job_id"] == job_id
    world = next(e for e in events if e.kind == "world_up")
    assert (world.size, world.launcher, world.job_id) == (3, "slurm", job_id)  # executors: outside it
    ranks = {r["rank"]: r for r in run.read_ranks()}
    hello_hosts = {e.cell: e.host for e in events if e.kind == "hello"}
    # One MPI_COMM_WORLD spans the components: the controller and each cell on its own emulated node.
    assert len({ranks[0]["host"], *hello_hosts.values()}) == 3
    first_roles = [(e.cell, e.role) for e in events if e.kind == "role_switched"][:2]
    assert sorted(first_roles) == [(0, "sampling"), (1, "sampling")]
    steps = [e for e in events if e.kind == "step"]
    assert (first.reward_mean, first.calls) == (alone[0].reward_mean, alone[0].calls)  # as on the controller
    placed = [e for e in events if e.kind == "placed"]
    assert {e.node for e in placed if e.t <= first.t} == {"node4", "node5"}  # spread over both
    assert sorted(up) == ["node4", "node5"] and len({e.host for e in up.values()}) == 1  # emulated nodes
    (lost,) = [e for e in events if e.kind == "executor_lost"]
    assert lost.node == "node4" and lost.runs  # it held executions when it died
    again = {e.run: e for e in placed if e.attempt == 2}
    assert sorted(again) == lost.runs and {e.node for e in again.values()} == {"node5"}
    assert [s.executions for s in steps] == [16, 16] and steps[1].statuses == {"finished": 16}
    assert all(s.tool_calls > 0 and s.controller_cpu_s > 0 for s in steps)  # what bench_executors reads
    state = wait_for_state(job_id, "COMPLETED", components=3)
    assert state.components == {f"{job_id}+{c}": "COMPLETED" for c in range(3)}
    for target in (str(run.path), job_id):
        proc = gyre("status", target, "--once", "--runs-dir", str(tmp_path / "slurm"))
        assert proc.returncode == 0, proc.stderr
        assert f"slurm job {job_id}: COMPLETED" in proc.stdout and "run: completed · step 2/2" in proc.stdout
