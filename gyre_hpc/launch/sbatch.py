"""The heterogeneous sbatch script, rendered by a pure function (golden-tested).

```
 component 0   controller      1 node, 1 task                 (rank 0)
 component 1   cells           cells × nodes_per_cell nodes,  (ranks 1 … cells·ranks_per_cell)
                               ranks_per_cell / nodes_per_cell tasks per node
 component 2   rollout pool    one node and one task per standalone engine (only if any)
 last          executor nodes  executors.nodes nodes, one executor task each (only if any)
```

One ``srun --mpi=pmix`` of ``:``-separated parts, ``--het-group=0 … : --het-group=1 …``, then
starts one MPI world across the components, in that order, which is exactly the rank order
``layout.RankLayout`` expects. Executor nodes are not in that world: a second ``srun`` of their
component starts one ``executors.node`` per node, so a lost executor node leaves the world (and
its step) going; they serve every world of the job and stop when the script ends. Output goes to
``<run_dir>/logs/slurm.out``: never ``%j`` in a path shared by components, it expands per component.
"""

from __future__ import annotations

import shlex
import string
from pathlib import Path

from gyre_hpc.errors import LaunchError
from gyre_hpc.plan.ranks import RankLayout
from gyre_hpc.recipe.schema import ExecutorsConfig, SlurmConfig
from gyre_hpc.rundir import EXIT, RunDir

TEMPLATE = Path(__file__).resolve().parents[2] / "sbatch" / "hetjob.sh"
SRUN_GRACE_S = 10  # how long srun may outlive every rank before the script stops it
EXECUTORS_STEP = "gyre-executors"
"""The executor nodes' job step: not one of the world's (the script's hang watch skips it)."""


class _Template(string.Template):
    delimiter = "@"  # the script is bash: leave every $ to it


def render_sbatch(
    slurm: SlurmConfig,
    layout: RankLayout,
    *,
    job_name: str,
    run_dir: Path,
    python: str,
    max_restarts: int = 0,
    template: Path = TEMPLATE,
    engines: str = "",
    executors: ExecutorsConfig | None = None,
) -> str:
    """The complete sbatch script for ``layout``; no I/O but reading the template. ``engines``:
    each cell's engine plan (``placement``), written into the script as comments."""
    components = [_controller(slurm), _cells(slurm, layout)]
    if layout.pool:
        components.append(_pool(slurm, layout))
    world = len(components)
    if executors is not None and executors.nodes:
        components.append(_executors(slurm, executors))
    common = [
        f"--job-name={job_name}",
        f"--output={RunDir(run_dir).slurm_out}",
        "--open-mode=append",  # a requeued job adds to the first attempt's output
        f"--time={slurm.time}",
        f"--chdir={run_dir}",
        "--requeue" if slurm.requeue else "--no-requeue",
    ]
    if slurm.signal_grace_s:
        common.append(f"--signal=B:USR2@{slurm.signal_grace_s}")
    common += _opt("account", slurm.account) + _opt("qos", slurm.qos)
    header = [f"#SBATCH {o}" for o in common + components[0]]
    for options in components[1:]:
        header += ["#SBATCH hetjob", *(f"#SBATCH {o}" for o in options)]
    try:
        text = template.read_text()
    except FileNotFoundError:
        raise LaunchError(
            f"sbatch template {template} is missing (install gyre-hpc from a checkout with pip -e)"
        ) from None
    return _Template(text).substitute(
        header="\n".join(header),
        engines="\n".join(f"#   {line}" for line in engines.splitlines()) or "#   (not given)",
        setup="\n".join(slurm.setup) if slurm.setup else "# (no slurm.setup lines)",
        run_dir=shlex.quote(str(run_dir)),
        python=shlex.quote(python),
        mpi=slurm.mpi,
        srun_components=_srun_components(components[:world]),
        executors_start=_executors_start(components, world),
        executors_step=EXECUTORS_STEP,
        srun_grace_s=SRUN_GRACE_S,
        world_size=layout.world_size,
        max_restarts=max_restarts,
        **_run_dir_names(RunDir(run_dir)),
    )


def _run_dir_names(rd: RunDir) -> dict[str, str]:
    """The run directory's files the script reads, relative to ``$RUN_DIR`` (``rundir`` names them)."""
    return {
        "ranks": str(rd.ranks.relative_to(rd.path)),
        "exit": EXIT,
        "requeue": str(rd.requeue_flag.relative_to(rd.path)),
        "slurm_out": str(rd.slurm_out.relative_to(rd.path)),
    }


def _srun_components(components: list[list[str]]) -> str:
    """One ``:``-separated part per component, each with the ``--cpus-per-task`` (and any
    ``--gpus-per-task``) its allocation asked for: since Slurm 22.05 srun takes no CPU count from
    the batch allocation, so without it each task (and an SGLang server with its several
    processes under a cell leader) may be bound to one CPU; GPUs per task are said again alike."""
    run = '"$PYTHON" -m gyre_hpc.runtime "$RUN_DIR"'
    per_task = ("--cpus-per-task=", "--gpus-per-task=")
    asked = [" ".join(o for o in opts if o.startswith(per_task)) for opts in components]
    parts = [f"    --het-group={i} {a} {run}" for i, a in enumerate(asked)]
    return " : \\\n".join(parts)


def _executors_start(components: list[list[str]], world: int) -> str:
    """The executor nodes' own srun, in the background (or a comment: none asked for)."""
    if len(components) == world:
        return "# (no executor nodes: executions run on the controller's node)"
    cpus = next(o for o in components[world] if o.startswith("--cpus-per-task="))
    return (
        f"srun --het-group={world} --job-name={EXECUTORS_STEP} --mpi=none --kill-on-bad-exit=0 {cpus} \\\n"
        '    "$PYTHON" -m gyre_hpc.executors "$RUN_DIR" &\nexecutors_pid=$!'
    )


def _executors(slurm: SlurmConfig, executors: ExecutorsConfig) -> list[str]:
    partition = executors.partition or slurm.controller_partition or slurm.partition
    return [
        f"--nodes={executors.nodes}",
        f"--ntasks={executors.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={executors.cpus_per_node}",
        *_opt("partition", partition),
        *_opt("mem", executors.mem),
        *_opt("constraint", executors.constraint),
    ]


def _controller(slurm: SlurmConfig) -> list[str]:
    partition = slurm.controller_partition or slurm.partition
    return [
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={slurm.controller_cpus}",
        *_opt("partition", partition),
    ]


def _cells(slurm: SlurmConfig, layout: RankLayout) -> list[str]:
    nodes = layout.cells * slurm.nodes_per_cell
    per_node = layout.ranks_per_cell // slurm.nodes_per_cell
    return [
        f"--nodes={nodes}",
        f"--ntasks={layout.cells * layout.ranks_per_cell}",
        f"--ntasks-per-node={per_node}",
        f"--cpus-per-task={slurm.cpus_per_task}",
        *_gpu_node(slurm),
    ]


def _pool(slurm: SlurmConfig, layout: RankLayout) -> list[str]:
    return [
        f"--nodes={layout.pool}",
        f"--ntasks={layout.pool}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={slurm.cpus_per_task}",
        *_gpu_node(slurm),
    ]


def _gpu_node(slurm: SlurmConfig) -> list[str]:
    opts = _opt("partition", slurm.partition)
    if slurm.gpus_per_node:
        opts.append(f"--gpus-per-node={slurm.gpus_per_node}")
    if slurm.gpu_per_task:
        opts.append("--gpus-per-task=1")
    opts += _opt("mem", slurm.mem) + _opt("constraint", slurm.constraint)
    if slurm.exclusive:
        opts.append("--exclusive")
    return opts


def _opt(name: str, value: str) -> list[str]:
    return [f"--{name}={value}"] if value else []
