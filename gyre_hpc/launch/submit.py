"""A run as ONE heterogeneous Slurm job: its script rendered (``launch.sbatch``) and submitted.

```
 recipe ─▶ job_script: the het job (controller, cells, pool, executors), engines placed
        ─▶ submit_run: RUN_DIR/job.sbatch ─▶ sbatch --parsable ─▶ job.json, event run_start
```

It knows nothing of what the job runs: the script starts ``python -m gyre_hpc.runtime RUN_DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gyre_hpc.errors import GyreError
from gyre_hpc.launch import slurm
from gyre_hpc.launch.sbatch import render_sbatch
from gyre_hpc.observability import events as ev
from gyre_hpc.plan.placement import cell_engines
from gyre_hpc.plan.ranks import RankLayout
from gyre_hpc.recipe import Recipe
from gyre_hpc.rundir import RunDir

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def job_script(r: Recipe, run_dir: Path) -> str:
    """The sbatch script of ``r``, writing into ``run_dir``."""
    if r.executors.nodes and r.proxy.host in LOOPBACK:
        raise GyreError(
            f"executors.nodes = {r.executors.nodes} with proxy.host = {r.proxy.host!r}: executor nodes "
            'cannot reach a proxy on loopback; set proxy.host = "0.0.0.0" (or the controller\'s address)'
        )
    return render_sbatch(
        r.slurm,
        RankLayout.from_config(r.cells),
        job_name=r.run.name,
        run_dir=run_dir,
        python=r.slurm.python or sys.executable,
        max_restarts=r.run.max_restarts,
        engines=cell_engines(r.cells, r.slurm, r.engine).describe(),
        executors=r.executors,
    )


def submit_run(r: Recipe, run_dir: RunDir) -> str:
    """The job submitted, its script and id kept in the run directory; the job id."""
    path = run_dir.job_script
    path.write_text(job_script(r, run_dir.path))
    job_id = slurm.submit(str(path))
    run_dir.write_job(launcher="slurm", job_id=job_id, script=str(path))
    with ev.EventLog(run_dir.events) as events:
        events.emit(ev.RunStart(launcher="slurm", job_id=job_id))
    return job_id
