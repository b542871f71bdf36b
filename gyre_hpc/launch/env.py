"""The job environment: the only reader of launcher variables (Slurm, Open MPI, gyre-hpc's own).

Nothing else in the package looks at ``os.environ`` for job facts. Under ``srun --het-group=0,1``
every task sees the whole step: ``SLURM_PROCID`` is its global index, ``SLURM_NTASKS`` the total,
``SLURM_NTASKS_HET_GROUP_<i>`` the size of component ``i``, and ``SLURM_JOB_ID`` the leader's id.
A task finds its component from its index and the running sum of component sizes.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

Launcher = Literal["mpirun", "slurm", "none"]


@dataclass(frozen=True)
class JobEnvironment:
    launcher: Launcher
    """Who started this process: mpirun (also inside an allocation), srun, or nobody."""
    rank: int
    """This task's global index as the launcher numbered it."""
    ntasks: int
    """How many tasks the launcher started; the MPI world must be exactly this big."""
    job_id: str | None
    """The Slurm job id (the het leader's id in every component), None outside Slurm."""
    het_sizes: tuple[int, ...]
    """Tasks per het component; empty when the job is not heterogeneous."""
    hostname: str
    node_name: str
    """The Slurm node name (emulated nodes share one hostname), else the hostname."""
    local_rank: int = 0
    """This task's index among the tasks of its node."""
    gpu: int = 0
    """The first GPU, among those this task sees, that it takes: its local rank where every task
    of a node sees the node's GPUs, 0 where Slurm binds GPUs to tasks (``--gpus-per-task``: each
    sees only its own)."""
    faults: tuple[str, ...] = ()
    """``GYRE_FAULT``: the fault points a test arms (``faults.points``); empty in a real run."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> JobEnvironment:
        env = os.environ if environ is None else environ
        hostname = socket.gethostname()
        het_sizes = _het_sizes(env)
        node = env.get("SLURMD_NODENAME", hostname)
        job_id = env.get("SLURM_JOB_ID")
        if "OMPI_COMM_WORLD_SIZE" in env:
            rank, ntasks, launcher = env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"], "mpirun"
            het_sizes = ()  # mpirun inside an allocation numbers its own world
        elif "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
            rank, ntasks, launcher = env["SLURM_PROCID"], env.get("SLURM_NTASKS", "1"), "slurm"
            if het_sizes:  # the step's own size: the executor nodes' component is not in the world
                ntasks = env.get("SLURM_STEP_NUM_TASKS") or str(sum(het_sizes))
        else:
            rank, ntasks, launcher = "0", "1", "none"
        local_key = "OMPI_COMM_WORLD_LOCAL_RANK" if launcher == "mpirun" else "SLURM_LOCALID"
        local = int(env.get(local_key) or 0)
        gpu = 0 if launcher == "slurm" and env.get("SLURM_GPUS_PER_TASK") else local
        faults = tuple(f for f in env.get("GYRE_FAULT", "").split(",") if f)
        return cls(launcher, int(rank), int(ntasks), job_id, het_sizes, hostname, node, local, gpu, faults)

    @property
    def het_group(self) -> int:
        """The het component this task belongs to (0 when not heterogeneous)."""
        for group, end in enumerate(accumulate(self.het_sizes)):
            if self.rank < end:
                return group
        return 0


def _het_sizes(env: Mapping[str, str]) -> tuple[int, ...]:
    sizes = []
    while f"SLURM_NTASKS_HET_GROUP_{len(sizes)}" in env:
        sizes.append(int(env[f"SLURM_NTASKS_HET_GROUP_{len(sizes)}"]))
    return tuple(sizes)
