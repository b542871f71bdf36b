"""Talking to Slurm: submit the rendered script, read job states, cancel.

Why not submitit's executor: submitit 1.5.4 cannot emit ``#SBATCH hetjob`` (its
``additional_parameters`` add options to one component only) and pickles a Python callable
per job, while a heterogeneous MPI world needs one script that starts ``srun`` over every
component. So ``sbatch.py`` renders the script and this module submits it with
``sbatch --parsable``. submitit's sacct watcher is still what reads job states (batched,
cached, with back-off); ``HetJobWatcher`` teaches it that sacct lists a het job as ``N+0``,
``N+1``, … which its parser would otherwise never match to job ``N``.

Every call to Slurm goes through ``_slurm`` — the one subprocess boundary tests may fake.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from submitit.slurm.slurm import SlurmInfoWatcher

from gyre_hpc.errors import LaunchError

# The state a job shows when its components disagree: a failure anywhere wins, then activity.
_FAILED = (
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)
_ACTIVE = ("RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "PENDING", "CONFIGURING")


def _slurm(args: list[str]) -> str:
    if shutil.which(args[0]) is None:
        raise LaunchError(
            f"{args[0]} not found: is Slurm installed here? (tools/local_slurm.sh for a local one)"
        )
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    if proc.returncode:
        raise LaunchError(
            f"{' '.join(args[:2])} failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
        )
    return proc.stdout


def submit(script_path: str) -> str:
    """Submit; the job id (a het job's id is its leader's)."""
    out = _slurm(["sbatch", "--parsable", script_path]).strip()
    return out.split(";")[0]


def cancel(job_id: str) -> None:
    _slurm(["scancel", job_id])


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str
    """The whole job's state: the worst of its components (see ``combine``)."""
    components: dict[str, str] = field(default_factory=dict)
    """``N+i`` -> state, for a het job."""
    source: str = "sacct"


def combine(states: list[str]) -> str:
    """One state for a het job from its components' states."""
    if not states:
        return "UNKNOWN"
    for s in _FAILED + _ACTIVE:
        if s in states:
            return s
    return "COMPLETED" if all(s == "COMPLETED" for s in states) else states[0]


class HetJobWatcher(SlurmInfoWatcher):
    """submitit's sacct watcher, also folding het components ``N+i`` into job ``N``."""

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        info = super().read_info(string)
        comps: dict[str, dict[str, str]] = {}
        for key, stats in info.items():
            if m := re.fullmatch(r"(\d+)\+(\d+)", key):
                comps.setdefault(m.group(1), {})[key] = stats.get("State", "UNKNOWN").split()[0]
        for job, states in comps.items():
            ordered = [states[k] for k in sorted(states, key=lambda k: int(k.split("+")[1]))]
            info[job] = {"JobID": job, "State": combine(ordered), "Components": states}  # type: ignore[dict-item]
        return info


def job_state(job_id: str, watcher: HetJobWatcher | None = None, mode: str = "force") -> JobState:
    """squeue while the job is in the queue (the controller's live view), then sacct.

    Accounting lags and, for a het job, first lists it as plain ``N`` before its components
    appear: it is only trusted once the job has left the queue.
    """
    live = _squeue_state(job_id)
    if live.state != "UNKNOWN":
        return live
    stats: dict[str, Any] = (watcher or HetJobWatcher(delay_s=60)).get_info(job_id, mode=mode)
    if stats.get("State"):
        return JobState(job_id, stats["State"].split()[0], dict(stats.get("Components", {})))
    return live


def _squeue_state(job_id: str) -> JobState:
    try:
        out = _slurm(["squeue", "-h", "-j", job_id, "-O", "HetJobOffset:|,State:"])
    except LaunchError:
        return JobState(job_id, "UNKNOWN", source="squeue")
    rows = [line.split("|")[:2] for line in out.splitlines() if "|" in line]
    if not rows:
        return JobState(job_id, "UNKNOWN", source="squeue")  # gone from the queue, no accounting
    states = [state.strip() for _, state in rows]
    het = {f"{job_id}+{offset.strip()}": state.strip() for offset, state in rows if offset.strip().isdigit()}
    return JobState(job_id, combine(states), het, source="squeue")
