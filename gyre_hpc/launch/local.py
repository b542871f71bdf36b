"""Local launch: the whole world under mpirun on this machine (``gyre-hpc run``).

The launcher owns mpirun: it starts it in a session of its own (so a terminal's Ctrl-C reaches
only the launcher), turns Ctrl-C or SIGTERM into SIGTERM for mpirun, escalates to SIGKILL of
mpirun's process group after a grace period, kills any rank still alive after that, and has the
kernel send mpirun SIGTERM should the launcher itself die. No rank outlives a launch.

SIGUSR2 is passed on to every rank (the controller checkpoints the step under way and stops:
``preempted``). With ``run.max_restarts`` a world that failed (a rank died) is started again,
from the newest checkpoint and the executions journalled after it (``runtime.resume``).

With ``executors.nodes`` the launcher also starts that many executor processes
(``executors.node``, named ``local-1`` …), outside the MPI world as on a cluster: they serve
every world of the run, and one that dies leaves the run going. None outlives the launch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

from gyre_hpc.launch.ending import diagnose, record
from gyre_hpc.launch.orphans import die_with_parent
from gyre_hpc.observability import events as ev
from gyre_hpc.plan.ranks import RankLayout
from gyre_hpc.rundir import RunDir

# Ranks outnumber cores on a laptop: busy-polling MPI would starve the controller. One machine has
# no InfiniBand, so ob1 (shared memory, TCP) is the pml; naming it skips the UCX pml's probe of
# every UCX transport in MPI_Init, which has crashed when two worlds start at once.
MPI_ENV = {
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_pml": "ob1",
    "OMPI_MCA_btl_tcp_if_include": "lo",
    "OMPI_MCA_oob_tcp_if_include": "lo",
    "PYTHONUNBUFFERED": "1",
}


def mpirun_command(layout: RankLayout, python: str, run_dir: Path, as_root: bool) -> list[str]:
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
    layout: RankLayout
    grace_s: float = 5.0
    python: str = sys.executable
    max_restarts: int = 0
    executors: int = 0
    """Local executor processes to start (``executors.nodes``)."""

    def launch(self, on_events: Callable[[list[ev.Event]], None] = lambda _: None) -> ev.RunEnd:
        """Run to the end, restarting the world up to ``max_restarts`` times after a failure;
        ``on_events`` sees new events as they come. Returns ``run_end``."""
        log_path = self.run_dir.launcher_log
        cmd = mpirun_command(self.layout, self.python, self.run_dir.path, os.geteuid() == 0)
        with ev.EventLog(self.run_dir.events) as events:
            events.emit(ev.RunStart(launcher="mpirun", command=cmd, pid=os.getpid()))
        self.run_dir.write_job(launcher="mpirun", pid=os.getpid(), command=cmd)
        tail = ev.EventTail(self.run_dir.events)
        attempt = 1
        executors = [self._start_executor(f"local-{i + 1}") for i in range(self.executors)]
        try:
            while True:
                returncode, interrupted, output = self._attempt(cmd, log_path, tail, on_events)
                end = diagnose(self.run_dir, returncode, interrupted, log_path, output)
                if end.status != "failed" or attempt > self.max_restarts:
                    break
                attempt += 1  # the world starts again from the newest checkpoint (runtime.resume)
                restart = ev.Restarting(attempt=attempt, reason=end.reason)
                try:
                    with ev.EventLog(self.run_dir.events) as events:
                        events.emit(restart)
                except OSError:
                    pass
                on_events(tail.new())
        finally:
            _stop_all(executors, self.grace_s)
        self.run_dir.requeue_flag.unlink(missing_ok=True)  # nothing requeues a local run: --resume does
        end = record(self.run_dir, end)
        on_events([end])
        return end

    def _attempt(
        self, cmd: list[str], log_path: Path, tail: ev.EventTail, on_events: Callable[[list[ev.Event]], None]
    ) -> tuple[int, bool, str]:
        """One world under mpirun: (exit code, interrupted, mpirun's last lines)."""
        interrupted_at: list[float] = []
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **MPI_ENV},
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        output = Output(log_path)
        pump = threading.Thread(target=output.copy, args=(proc.stdout,), name="mpirun-output", daemon=True)
        pump.start()
        previous = _trap_signals(
            lambda: (interrupted_at.append(time.monotonic()), _signal_group(proc)),
            on_usr2=lambda: proc.send_signal(signal.SIGUSR2),  # mpirun passes it to every rank
        )
        try:
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
            pump.join(5)
            self._kill_leftover_ranks()
        return proc.returncode, bool(interrupted_at), output.tail()

    def _start_executor(self, name: str) -> subprocess.Popen[bytes]:
        """One executor process, its output in ``logs/executor-<name>.log`` beside its own log."""
        with self.run_dir.executor_log(name).open("ab") as out:
            return subprocess.Popen(
                [self.python, "-m", "gyre_hpc.executors", str(self.run_dir.path), "--node", name],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def _kill_leftover_ranks(self) -> None:
        """SIGKILL any rank of this run still alive (checked by its command line, not just its pid)."""
        for rank in self.run_dir.read_ranks():
            try:
                cmdline = Path(f"/proc/{rank['pid']}/cmdline").read_bytes()
                if str(self.run_dir.path).encode() in cmdline:
                    os.kill(rank["pid"], signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass


class Output:
    """mpirun's output: copied into the run's log as it comes (best effort: the disk may be the
    reason the run fails) and its last lines kept here, so the reason survives a full disk."""

    def __init__(self, log_path: Path, keep: int = 200) -> None:
        self.log_path, self.lines = log_path, deque[bytes](maxlen=keep)

    def copy(self, stream: IO[bytes]) -> None:
        try:
            log: IO[bytes] | None = self.log_path.open("ab")  # a resumed run keeps earlier attempts
        except OSError:
            log = None
        for line in stream:
            self.lines.append(line)
            if log is not None:
                try:
                    log.write(line)
                    log.flush()
                except OSError:
                    log = None
        if log is not None:
            try:
                log.close()
            except OSError:
                pass

    def tail(self) -> str:
        return b"".join(self.lines).decode(errors="replace")


def _stop_all(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM (each ends its executions and their processes), then SIGKILL after ``grace_s``."""
    for proc in procs:
        _signal_group(proc)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen[bytes], signum: int = signal.SIGTERM) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


def _trap_signals(handler: Callable[[], Any], on_usr2: Callable[[], Any]) -> dict[int, Any]:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        (on_usr2 if signum == signal.SIGUSR2 else handler)()

    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}


def _restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)
