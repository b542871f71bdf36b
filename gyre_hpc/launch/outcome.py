"""How a run ended: the ``run_end`` event, derived the same way for mpirun and Slurm launches.

The launcher (``gyre-hpc run``, or the sbatch script after ``srun``) knows the exit code and
whether it was interrupted; the ranks left ``rank_failed`` events; mpirun and srun left a log.
This module turns those into one status (completed | failed | interrupted) and one line of
reason that names the failing rank.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from gyre_hpc.observability import events as ev
from gyre_hpc.rundir import RunDir

# mpirun: "mpirun noticed that process rank 1 with PID 123 on node vm exited on signal 9 (Killed)."
# srun:   "srun: error: node2: task 1: Killed"
_LAUNCHER_DEATH = re.compile(
    r"(process rank \d+ with PID \d+ on node \S+ exited on signal \d+.*?)\.?$"
    r"|error: (\S+: task \d+: .+)$",
    re.M,
)


def diagnose(run_dir: RunDir, returncode: int, interrupted: bool, launcher_log: Path | None) -> ev.RunEnd:
    """The ``run_end`` record of a launch that has ended."""
    if interrupted:
        return ev.RunEnd(status="interrupted", reason="stopped by a signal", returncode=returncode)
    failed = any(isinstance(e, ev.RankFailed) for e in run_dir.read_events())
    if returncode == 0 and not failed:
        return ev.RunEnd(status="completed")
    return ev.RunEnd(
        status="failed", reason=failure_reason(run_dir, returncode, launcher_log), returncode=returncode
    )


def failure_reason(run_dir: RunDir, returncode: int, launcher_log: Path | None) -> str:
    for e in run_dir.read_events():
        if isinstance(e, ev.RankFailed):
            where = f"cell {e.cell}" if e.cell is not None else "controller"
            if e.rank == 0 and e.task != 0:
                where = f"task {e.task}"
            return f"rank {e.rank} ({where} on {e.host}) failed: {e.error}"
    text = launcher_log.read_text(errors="replace") if launcher_log and launcher_log.exists() else ""
    if match := _LAUNCHER_DEATH.search(text):
        return _name_cell(run_dir, match.group(1) or match.group(2))
    return f"the launcher exited with code {returncode}; see {run_dir.logs}"


def _name_cell(run_dir: RunDir, line: str) -> str:
    """Add the role of the rank a launcher line names (mpirun numbers ranks as we do)."""
    match = re.search(r"(?:rank|task) (\d+)", line)
    ranks = {r["rank"]: r for r in run_dir.read_ranks()}
    if match and (info := ranks.get(int(match.group(1)))):
        role = "controller" if info.get("cell") is None else f"cell {info['cell']}"
        return f"rank {info['rank']} ({role}) died: {line}"
    return f"a rank died: {line}"


def conclude(run_dir: RunDir, returncode: int, interrupted: bool, launcher_log: Path | None) -> ev.RunEnd:
    """Record ``run_end`` and return it."""
    with ev.EventLog(run_dir.events) as events:
        end = events.emit(diagnose(run_dir, returncode, interrupted, launcher_log))
    assert isinstance(end, ev.RunEnd)
    return end


def main(argv: list[str] | None = None) -> int:
    """``python -m gyre_hpc.launch.outcome RUN_DIR RC [interrupted] [LOG]`` (the sbatch script's epilogue)."""
    args = sys.argv[1:] if argv is None else argv
    run_dir, rc = RunDir(Path(args[0])), int(args[1])
    interrupted = len(args) > 2 and args[2] == "interrupted"
    log = Path(args[3]) if len(args) > 3 else None
    end = conclude(run_dir, rc, interrupted, log)
    print(f"gyre-hpc: run {end.status}" + (f": {end.reason}" if end.reason else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
