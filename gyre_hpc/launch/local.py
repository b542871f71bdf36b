"""Local launch: the whole world under mpirun on this machine (``gyre-hpc run``).

The launcher owns mpirun: it starts it in a session of its own (so a terminal's Ctrl-C reaches
only the launcher), turns Ctrl-C or SIGTERM into SIGTERM for mpirun, escalates to SIGKILL of
mpirun's process group after a grace period, kills any rank still alive after that, and has the
kernel send mpirun SIGTERM should the launcher itself die. No rank outlives a launch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from gyre_hpc.launch.outcome import conclude
from gyre_hpc.layout import Layout
from gyre_hpc.observability import events as ev
from gyre_hpc.rundir import RunDir

# Ranks outnumber cores on a laptop: busy-polling MPI would starve the controller.
MPI_ENV = {
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_btl_tcp_if_include": "lo",
    "OMPI_MCA_oob_tcp_if_include": "lo",
    "PYTHONUNBUFFERED": "1",
}


def mpirun_command(layout: Layout, python: str, run_dir: Path, as_root: bool) -> list[str]:
    """The mpirun line that starts every rank of ``layout`` on this machine."""
    root = ["--allow-run-as-root"] if as_root else []
    return [
        "mpirun",
        *root,
        "--oversubscribe",
        "--bind-to",
        "none",
        "-n",
        str(layout.world_size),
        python,
        "-m",
        "gyre_hpc.runtime",
        str(run_dir),
    ]


@dataclass
class LocalRun:
    run_dir: RunDir
    layout: Layout
    grace_s: float = 5.0
    python: str = sys.executable

    def launch(self, on_events: Callable[[list[ev.Event]], None] = lambda _: None) -> ev.RunEnd:
        """Run to the end; ``on_events`` sees new events as they come. Returns ``run_end``."""
        log_path = self.run_dir.logs / "mpirun.log"
        cmd = mpirun_command(self.layout, self.python, self.run_dir.path, os.geteuid() == 0)
        with ev.EventLog(self.run_dir.events) as events:
            events.emit(ev.RunStart(launcher="mpirun", command=cmd, pid=os.getpid()))
        self.run_dir.write_job(launcher="mpirun", pid=os.getpid(), command=cmd)
        interrupted_at: list[float] = []
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **MPI_ENV},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            previous = _trap_signals(lambda: (interrupted_at.append(time.monotonic()), _signal_group(proc)))
            try:
                tail = ev.EventTail(self.run_dir.events)
                while proc.poll() is None:
                    on_events(tail.new())
                    if interrupted_at and time.monotonic() - interrupted_at[0] > self.grace_s:
                        _signal_group(proc, signal.SIGKILL)
                    time.sleep(0.1)
                on_events(tail.new())
            finally:
                _restore_signals(previous)
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
                self._kill_leftover_ranks()
        end = conclude(self.run_dir, proc.returncode, bool(interrupted_at), log_path)
        on_events([end])
        return end

    def _kill_leftover_ranks(self) -> None:
        """SIGKILL any rank of this run still alive (checked by its command line, not just its pid)."""
        for rank in self.run_dir.read_ranks():
            try:
                cmdline = Path(f"/proc/{rank['pid']}/cmdline").read_bytes()
                if str(self.run_dir.path).encode() in cmdline:
                    os.kill(rank["pid"], signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass


def _die_with_parent() -> None:
    """In the child: the kernel sends SIGTERM if the launcher dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _signal_group(proc: subprocess.Popen[bytes], signum: int = signal.SIGTERM) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


def _trap_signals(handler: Callable[[], Any]) -> dict[int, Any]:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        handler()

    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}


def _restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)
