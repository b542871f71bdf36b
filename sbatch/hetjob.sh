#!/bin/bash
# gyre-hpc heterogeneous job, rendered by `gyre-hpc submit` (gyre_hpc/launch/sbatch.py).
# One MPI world across all components: rank 0 is the controller, then the cells.
@{header}
# The engine replicas of each cell (each started by the cell rank named; gyre_hpc/plan/placement.py):
@{engines}
set -u
@{setup}
export PYTHONUNBUFFERED=1
# Debian's Open MPI disables osc/ucx, without which one-sided windows fail across nodes.
export OMPI_MCA_osc=${OMPI_MCA_osc:-sm,ucx}
# One NCCL_CUMEM_ENABLE for every rank: a trainer's groups span ranks that host a server (SGLang
# sets 0 where it is unset) and ranks that do not.
export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}
RUN_DIR=@{run_dir}
PYTHON=@{python}

MAX_RESTARTS=@{max_restarts}

# scancel or preemption: SIGTERM reaches this script and every task; remember it for the record.
# Near the time limit Slurm sends SIGUSR2 (--signal=B:): pass it to the tasks; the controller
# checkpoints the step under way, stops, and leaves $RUN_DIR/@{requeue} (requeued below).
interrupted="" srun_pid=""
trap 'interrupted=interrupted; [ -z "$srun_pid" ] || kill -TERM "$srun_pid" 2>/dev/null' TERM INT
executors_pid=""
trap '[ -z "$srun_pid" ] || kill -USR2 "$srun_pid" 2>/dev/null' USR2

# One MPI world over every component; leaves its exit code in rc.
run_world() {
  rm -f "$RUN_DIR"/@{ranks}/*@{exit}   # each rank leaves its exit code here
  # Each component's tasks get its CPUs: srun no longer takes --cpus-per-task from sbatch.
  srun --mpi=@{mpi} --kill-on-bad-exit=1 \
@{srun_components} &
  srun_pid=$!
  # Slurm 22.05's pmix plugin can leave srun hanging after every task of a het step has exited
  # (it never joins its abort agent). Once every rank has left its exit code and srun is still
  # here after a grace period, stop srun and take the highest of those codes.
  # Interrupted, the same hang must not outlast KillWait, after which Slurm kills this script
  # before it could record how the run ended.
  # It hangs the same way when ranks were killed and left no code: once the job has no step
  # left but this script's own, srun is overdue too (and the world failed).
  rc="" overdue=0 stepless=0 stepped="" waited=0
  while kill -0 "$srun_pid" 2>/dev/null; do
    sleep 1
    if [ -n "$interrupted" ]; then
      [ $((waited += 1)) -lt 3 ] || { kill -KILL "$srun_pid"; break; }
      continue
    fi
    exited=$(find "$RUN_DIR/@{ranks}" -name '*@{exit}' 2>/dev/null | wc -l)
    if [ "$exited" -ge @{world_size} ] && [ $((overdue += 1)) -ge @{srun_grace_s} ]; then
      echo "gyre-hpc: srun outlived every rank by ${overdue}s; stopping it" >&2
      kill -KILL "$srun_pid"; wait "$srun_pid" 2>/dev/null
      rc=$(cat "$RUN_DIR"/@{ranks}/*@{exit} | sort -n | tail -n 1); break
    fi
    steps=$(squeue -h --steps -j "$SLURM_JOB_ID" -O StepId:64,StepName:64 2>/dev/null |
      awk '$1 !~ /[.](batch|extern)$/ && $2 != "@{executors_step}"' | wc -l)
    if [ "$steps" -gt 0 ]; then stepped=1 stepless=0
    elif [ -n "$stepped" ] && [ $((stepless += 1)) -ge @{srun_grace_s} ]; then
      echo "gyre-hpc: srun outlived its job steps by ${stepless}s; stopping it" >&2
      kill -KILL "$srun_pid"; wait "$srun_pid" 2>/dev/null
      rc=1; break
    fi
  done
  [ -n "$rc" ] || { wait "$srun_pid"; rc=$?; }
  srun_pid=""
  # The same plugin can also crash srun itself at teardown ("double free", SIGABRT) after every
  # rank ended: when each rank left its code, those codes are the truth.
  if [ -z "$interrupted" ] && [ "$(find "$RUN_DIR/@{ranks}" -name '*@{exit}' | wc -l)" -ge @{world_size} ]; then
    ranks_rc=$(cat "$RUN_DIR"/@{ranks}/*@{exit} | sort -n | tail -n 1)
    [ "$ranks_rc" = "$rc" ] || echo "gyre-hpc: srun exited $rc after every rank had ended ($ranks_rc)" >&2
    rc=$ranks_rc
  fi
}

# Executor nodes run the executions, outside the MPI world; they serve every world of this job.
@{executors_start}

# A world that failed (a rank died: node loss, OOM) starts again from the newest checkpoint and
# the executions journalled after it, up to run.max_restarts times.
restarts=0
rm -f "$RUN_DIR/@{requeue}"   # left only by a preemption of this job
while :; do
  run_world
  if [ "$rc" = 0 ] || [ -n "$interrupted" ] || [ "$restarts" -ge "$MAX_RESTARTS" ]; then break; fi
  restarts=$((restarts + 1))
  "$PYTHON" -m gyre_hpc.launch.ending "$RUN_DIR" "$rc" restarting "$RUN_DIR/@{slurm_out}"
done
# The executor nodes end their executions (and their processes) on SIGTERM; KILL after a grace.
if [ -n "$executors_pid" ]; then
  kill -TERM "$executors_pid" 2>/dev/null
  for _ in $(seq @{srun_grace_s}); do kill -0 "$executors_pid" 2>/dev/null || break; sleep 1; done
  kill -KILL "$executors_pid" 2>/dev/null; wait "$executors_pid" 2>/dev/null
fi
"$PYTHON" -m gyre_hpc.launch.ending "$RUN_DIR" "$rc" "${interrupted:-ended}" "$RUN_DIR/@{slurm_out}"
if [ -e "$RUN_DIR/@{requeue}" ] && [ -z "$interrupted" ]; then
  rm -f "$RUN_DIR/@{requeue}"
  scontrol requeue "$SLURM_JOB_ID" && echo "gyre-hpc: job $SLURM_JOB_ID requeued; it resumes by itself"
fi
exit "$rc"
