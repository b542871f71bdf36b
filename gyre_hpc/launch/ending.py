"""How a run ended: the ``run_end`` event, derived the same way for mpirun and Slurm launches.

The launcher (``gyre-hpc run``, or the sbatch script after ``srun``) knows the exit code and
whether it was interrupted; the ranks left ``rank_failed`` events; mpirun and srun left a log
(and ``gyre-hpc run`` keeps its last lines in memory too). This module turns those into one status
(completed | failed | interrupted | preempted) and one line of reason that names the failing rank. Recording
it is best effort: a run that failed because its disk is full still ends, and still says why.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TypeVar

from gyre_hpc.diskspace import MIB, free_bytes
from gyre_hpc.observability import events as ev
from gyre_hpc.plan.ranks import RankLayout
from gyre_hpc.rundir import RunDir

E = TypeVar("E", bound=ev.Event)

# mpirun: "mpirun noticed that process rank 1 with PID 123 on node vm exited on signal 9 (Killed)."
# srun:   "srun: error: node2: task 1: Killed"
_LAUNCHER_DEATH = re.compile(
    r"(process rank \d+ with PID \d+ on node \S+ exited on signal \d+.*?)\.?$"
    r"|error: (\S+: task \d+: .+)$",
    re.M,
)
_ATTEMPT_END = re.compile(r"^gyre-hpc: (?:run \w+|restarting)\b.*$", re.M)
# A rank's own last words (runtime.main), for when its rank_failed event could not be written.
_RANK_FAILED = re.compile(r"^gyre-hpc: rank (\d+) failed: (.+)$", re.M)


def diagnose(
    run_dir: RunDir, returncode: int, interrupted: bool, launcher_log: Path | None, output: str | None = None
) -> ev.RunEnd:
    """The ``run_end`` record of a launch that has ended; ``output``: the launcher's last lines."""
    if interrupted:
        return ev.RunEnd(status="interrupted", reason="stopped by a signal", returncode=returncode)
    events = this_attempt(run_dir.read_events())
    failed = any(isinstance(e, ev.RankFailed) for e in events)
    if returncode == 0 and not failed:
        if preempted := next((e for e in events if isinstance(e, ev.Preempted)), None):
            reason = f"SIGUSR2: checkpointed step {preempted.step} ({preempted.checkpoint})"
            return ev.RunEnd(status="preempted", reason=reason)
        return ev.RunEnd(status="completed")
    reason = failure_reason(run_dir, returncode, launcher_log, output)
    return ev.RunEnd(status="failed", reason=reason, returncode=returncode)


def this_attempt(events: list[ev.Event]) -> list[ev.Event]:
    """The events since the previous attempt of the run ended (a restart, a requeue, a resume)."""
    ends = [i for i, e in enumerate(events) if isinstance(e, (ev.RunEnd, ev.Restarting))]
    return events[ends[-1] + 1 :] if ends else events


def failure_reason(
    run_dir: RunDir, returncode: int, launcher_log: Path | None, output: str | None = None
) -> str:
    for e in this_attempt(run_dir.read_events()):
        if isinstance(e, ev.RankFailed):
            where = f"cell {e.cell}" if e.cell is not None else "controller"
            if e.rank == 0 and e.task != 0:
                where = f"task {e.task}"
            return f"rank {e.rank} ({where} on {e.host}) failed: {e.error}"
    # The first death of this attempt is the cause (the others follow from it).
    text = output if output is not None else _since_last_attempt(_read(launcher_log))
    if own := _RANK_FAILED.search(text):
        return _name_cell(run_dir, f"rank {own.group(1)}", "failed: " + own.group(2))
    if match := _LAUNCHER_DEATH.search(text):
        return _name_cell(run_dir, match.group(1) or match.group(2))
    return f"the launcher exited with code {returncode}; see {run_dir.logs}"


def _name_cell(run_dir: RunDir, line: str, what: str = "") -> str:
    """Name the rank a launcher line means, its role and node. mpirun numbers ranks as we do;
    srun names a node and a task numbered within its het component."""
    ranks = {r["rank"]: r for r in run_dir.read_ranks()}
    rank = None
    if srun := re.search(r"(\S+): task (\d+)", line):
        rank = _global_rank(run_dir, ranks, srun.group(1), int(srun.group(2)))
    elif match := re.search(r"(?:rank|task) (\d+)", line):
        rank = int(match.group(1))
    if rank is not None and (info := ranks.get(rank)):
        role = "controller" if info.get("cell") is None else f"cell {info['cell']}"
        return f"rank {rank} ({role} on {info.get('host')}) {what or 'died: ' + line}"
    return f"a rank {what or 'died: ' + line}"


def _global_rank(run_dir: RunDir, ranks: dict[int, dict], node: str, task: int) -> int | None:
    """The global rank of srun's ``task`` on ``node``: tasks count from 0 in each het component
    (the controller, the cells, the rollout pool), whose first global ranks the layout gives."""
    here = sorted(r for r, info in ranks.items() if info.get("host") == node)
    if not here or not run_dir.recipe_path.exists():
        return None
    layout = RankLayout.from_config(run_dir.read_recipe().cells)
    firsts = [0, 1, 1 + layout.cells * layout.ranks_per_cell]  # where each component starts
    return max(f for f in firsts if f <= here[0]) + task


def conclude(
    run_dir: RunDir, returncode: int, interrupted: bool, launcher_log: Path | None, output: str | None = None
) -> ev.RunEnd:
    """Record ``run_end`` (if the disk lets us) and return it."""
    return record(run_dir, diagnose(run_dir, returncode, interrupted, launcher_log, output))


def record(run_dir: RunDir, end: E) -> E:
    """Write ``end`` (if the disk lets us); returns it with its time."""
    try:
        with ev.EventLog(run_dir.events) as events:
            end = events.emit(end)
    except OSError:  # a full or lost disk: the launcher still tells
        pass
    return end


def _since_last_attempt(text: str) -> str:
    """A log appended across attempts, from the end of the previous one (the line this module
    prints when an attempt ends)."""
    ends = [m.end() for m in _ATTEMPT_END.finditer(text)]
    return text[ends[-1] :] if ends else text


def _read(path: Path | None) -> str:
    try:
        return path.read_text(errors="replace") if path else ""
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    """``python -m gyre_hpc.launch.ending RUN_DIR RC [interrupted|ended|restarting] [LOG]``: the
    sbatch script's epilogue, or its note that it starts the world again."""
    args = sys.argv[1:] if argv is None else argv
    run_dir, rc = RunDir(Path(args[0])), int(args[1])
    interrupted = len(args) > 2 and args[2] == "interrupted"
    log = Path(args[3]) if len(args) > 3 else None
    if len(args) > 2 and args[2] == "restarting":  # the batch script starts the world again
        reason = diagnose(run_dir, rc, False, log).reason
        attempt = 1 + sum(isinstance(e, ev.WorldUp) for e in run_dir.read_events())
        record(run_dir, ev.Restarting(attempt=attempt, reason=reason))
        print(f"gyre-hpc: restarting (attempt {attempt}): {reason}", flush=True)
        return 0
    end = conclude(run_dir, rc, interrupted, log)
    print(f"gyre-hpc: run {end.status}" + (f": {end.reason}" if end.reason else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def resume_hint(run_dir: Path, reason: str) -> str:
    """How to continue a run that ended for ``reason``; on a disk still too full to take a
    checkpoint, what to free instead (a --resume there would fail the same way)."""
    if "no space left on device" in reason:
        free = free_bytes(run_dir) / MIB
        needed = re.search(r"needs (\d+) MiB", reason)
        if needed is None or free < int(needed[1]):
            return f"not resumable yet: {free:.0f} MiB free under {run_dir}; make room first"
    return f"continue it: gyre-hpc run --resume {run_dir}"
