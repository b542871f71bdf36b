"""Reading job states: sacct lists a het job as N+0, N+1, ... which must fold into job N."""

from __future__ import annotations

import pytest

from gyre_hpc.launch import slurm
from gyre_hpc.launch.slurm import HetJobWatcher, combine

SACCT = """JobID|State|NodeList
12+0|RUNNING|node1
12+0.batch|RUNNING|node1
12+0.0|RUNNING|node1
12+1|FAILED|node[2-3]
12+1.0|FAILED|node[2-3]
13|COMPLETED|node1
14+0|CANCELLED by 0|node1
14+1|CANCELLED by 0|node2
"""


def test_het_components_fold_into_the_job() -> None:
    info = HetJobWatcher(delay_s=0).read_info(SACCT)
    assert info["12"]["State"] == "FAILED"
    assert info["12"]["Components"] == {"12+0": "RUNNING", "12+1": "FAILED"}
    assert info["13"]["State"] == "COMPLETED"
    assert info["14"]["State"] == "CANCELLED"


@pytest.mark.parametrize(
    ("states", "combined"),
    [
        (["COMPLETED", "COMPLETED"], "COMPLETED"),
        (["RUNNING", "PENDING"], "RUNNING"),
        (["COMPLETED", "TIMEOUT"], "TIMEOUT"),
        (["PENDING", "PENDING"], "PENDING"),
        ([], "UNKNOWN"),
    ],
)
def test_combine(states: list[str], combined: str) -> None:
    assert combine(states) == combined


def test_squeue_is_trusted_while_the_job_is_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake(args: list[str]) -> str:  # the one subprocess boundary
        calls.append(args[0])
        return "0|RUNNING|\n1|PENDING|\n"  # squeue -O HetJobOffset:|,State:

    monkeypatch.setattr(slurm, "_slurm", fake)
    watcher = HetJobWatcher(delay_s=0)
    monkeypatch.setattr(watcher, "get_info", lambda job_id, mode="standard": {"State": "PENDING"})  # lagging
    state = slurm.job_state("7", watcher)
    assert (state.state, state.components, state.source) == (
        "RUNNING",
        {"7+0": "RUNNING", "7+1": "PENDING"},
        "squeue",
    )


def test_sacct_once_the_job_left_the_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm, "_slurm", lambda args: "")  # squeue: gone
    watcher = HetJobWatcher(delay_s=0)
    monkeypatch.setattr(watcher, "get_info", lambda job_id, mode="standard": watcher.read_info(SACCT)[job_id])
    state = slurm.job_state("12", watcher)
    assert (state.state, state.source) == ("FAILED", "sacct")
