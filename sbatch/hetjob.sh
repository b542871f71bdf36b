#!/bin/bash
# gyre-hpc heterogeneous job, rendered by `gyre-hpc submit` (gyre_hpc/launch/sbatch.py).
# One MPI world across all components: rank 0 is the controller, then the cells.
@{header}
set -u
@{setup}
export PYTHONUNBUFFERED=1
# Debian's Open MPI disables osc/ucx, without which one-sided windows fail across nodes.
export OMPI_MCA_osc=${OMPI_MCA_osc:-sm,ucx}
RUN_DIR=@{run_dir}
PYTHON=@{python}

# scancel or preemption: SIGTERM reaches this script and every task; remember it for the record.
# Near the time limit Slurm sends SIGUSR2 (--signal): pass it to the tasks to checkpoint.
interrupted=""
trap 'interrupted=interrupted; kill -TERM "$srun_pid" 2>/dev/null' TERM INT
trap 'kill -USR2 "$srun_pid" 2>/dev/null' USR2

step_running() { squeue -h -s -j "$SLURM_JOB_ID" -o %i 2>/dev/null | grep -q "^$SLURM_JOB_ID\.0$"; }
step_rc() {  # the highest exit code of the MPI step's components, from accounting
  sacct -n -P -j "$SLURM_JOB_ID" -o JobID,ExitCode 2>/dev/null |
    awk -F'[|:]' '$1 ~ /\.0$/ && $2 > rc { rc = $2 } END { print rc + 0 }'
}

srun --mpi=@{mpi} --het-group=@{het_groups} --kill-on-bad-exit=1 \
  "$PYTHON" -m gyre_hpc.runtime "$RUN_DIR" &
srun_pid=$!
# Slurm 22.05's pmix plugin can leave srun hanging after every task of a het step has exited
# (it never joins its abort agent). Once Slurm reports the step gone and srun is still here
# after a grace period, stop srun and take the tasks' exit codes from accounting.
rc="" seen=0 overdue=0
while kill -0 "$srun_pid" 2>/dev/null; do
  sleep 2
  if step_running; then seen=1; overdue=0
  elif [ "$seen" = 1 ] && [ -z "$interrupted" ] && [ $((overdue += 2)) -ge @{srun_grace_s} ]; then
    echo "gyre-hpc: srun outlived its step by ${overdue}s; stopping it" >&2
    kill -KILL "$srun_pid"; rc=$(step_rc); break
  fi
done
[ -n "$rc" ] || { wait "$srun_pid"; rc=$?; }
"$PYTHON" -m gyre_hpc.launch.outcome "$RUN_DIR" "$rc" "${interrupted:-ended}" "$RUN_DIR/logs/slurm.out"
exit "$rc"
