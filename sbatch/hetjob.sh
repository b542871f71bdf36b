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

rm -f "$RUN_DIR"/ranks/*.exit   # each rank leaves its exit code here (a requeue starts afresh)
srun --mpi=@{mpi} --het-group=@{het_groups} --kill-on-bad-exit=1 \
  "$PYTHON" -m gyre_hpc.runtime "$RUN_DIR" &
srun_pid=$!
# Slurm 22.05's pmix plugin can leave srun hanging after every task of a het step has exited
# (it never joins its abort agent). Once every rank has left its exit code and srun is still
# here after a grace period, stop srun and take the highest of those codes.
# Interrupted, the same hang must not outlast KillWait, after which Slurm kills this script
# before it could record how the run ended.
rc="" overdue=0 waited=0
while kill -0 "$srun_pid" 2>/dev/null; do
  sleep 1
  if [ -n "$interrupted" ]; then
    [ $((waited += 1)) -lt 3 ] || { kill -KILL "$srun_pid"; break; }
    continue
  fi
  exited=$(find "$RUN_DIR/ranks" -name '*.exit' 2>/dev/null | wc -l)
  if [ "$exited" -ge @{world_size} ] && [ $((overdue += 1)) -ge @{srun_grace_s} ]; then
    echo "gyre-hpc: srun outlived every rank by ${overdue}s; stopping it" >&2
    kill -KILL "$srun_pid"; wait "$srun_pid" 2>/dev/null
    rc=$(cat "$RUN_DIR"/ranks/*.exit | sort -n | tail -n 1); break
  fi
done
[ -n "$rc" ] || { wait "$srun_pid"; rc=$?; }
# The same plugin can also crash srun itself at teardown ("double free", SIGABRT) after every rank
# ended: when each rank left its code, those codes are the truth.
if [ -z "$interrupted" ] && [ "$(find "$RUN_DIR/ranks" -name '*.exit' | wc -l)" -ge @{world_size} ]; then
  ranks_rc=$(cat "$RUN_DIR"/ranks/*.exit | sort -n | tail -n 1)
  [ "$ranks_rc" = "$rc" ] || echo "gyre-hpc: srun exited $rc after every rank had ended ($ranks_rc)" >&2
  rc=$ranks_rc
fi
"$PYTHON" -m gyre_hpc.launch.outcome "$RUN_DIR" "$rc" "${interrupted:-ended}" "$RUN_DIR/logs/slurm.out"
exit "$rc"
