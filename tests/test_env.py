"""JobEnvironment: the one reader of launcher variables."""

from __future__ import annotations

from gyre_hpc.launch.env import JobEnvironment


def test_outside_any_launcher() -> None:
    env = JobEnvironment.from_environ({})
    assert (env.launcher, env.rank, env.ntasks, env.job_id, env.het_group) == ("none", 0, 1, None, 0)


def test_mpirun() -> None:
    env = JobEnvironment.from_environ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"})
    assert (env.launcher, env.rank, env.ntasks, env.local_rank) == ("mpirun", 2, 3, 0)
    env = JobEnvironment.from_environ(
        {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    )
    assert env.local_rank == 1  # its GPU on the node


def test_mpirun_inside_an_allocation_is_mpirun() -> None:
    env = JobEnvironment.from_environ(
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "4",
            "SLURM_JOB_ID": "9",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
        }
    )
    assert (env.launcher, env.rank, env.ntasks, env.job_id) == ("mpirun", 1, 4, "9")


def het_step(procid: int) -> dict[str, str]:
    """What srun --het-group=0,1,2 sets in a task (as seen on slurm-wlm 22.05)."""
    return {
        "SLURM_JOB_ID": "41",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": "7",
        "SLURM_NTASKS_HET_GROUP_0": "1",
        "SLURM_NTASKS_HET_GROUP_1": "4",
        "SLURM_NTASKS_HET_GROUP_2": "2",
        "SLURMD_NODENAME": f"node{procid}",
        "SLURM_LOCALID": str(procid % 2),
    }


def test_het_component_from_procid_and_component_sizes() -> None:
    groups = [JobEnvironment.from_environ(het_step(p)).het_group for p in range(7)]
    assert groups == [0, 1, 1, 1, 1, 2, 2]
    assert [JobEnvironment.from_environ(het_step(p)).local_rank for p in range(4)] == [0, 1, 0, 1]
    env = JobEnvironment.from_environ(het_step(3))
    assert (env.launcher, env.ntasks, env.job_id, env.het_sizes, env.node_name) == (
        "slurm",
        7,
        "41",
        (1, 4, 2),
        "node3",
    )


def test_batch_script_is_not_a_task() -> None:
    env = JobEnvironment.from_environ({"SLURM_JOB_ID": "41", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert env.launcher == "none"


def test_a_task_takes_its_local_rank_s_gpu_or_the_first_of_its_own() -> None:
    """GPUs per node: every task sees the node's and takes its local rank's; GPUs per task: Slurm
    shows each task only its own, so it takes the first."""
    per_node = JobEnvironment.from_environ(het_step(3))
    assert (per_node.local_rank, per_node.gpu) == (1, 1)
    per_task = JobEnvironment.from_environ({**het_step(3), "SLURM_GPUS_PER_TASK": "4"})
    assert (per_task.local_rank, per_task.gpu) == (1, 0)
