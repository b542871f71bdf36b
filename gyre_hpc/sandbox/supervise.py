"""Running one process of an execution to its end: its output streamed and cut, its time, its
workspace's quota and its output watched, and its whole group killed when any is broken.

```
 Popen(argv) ──stdout+stderr──▶ kept: the first ¾ and the last ¼ of keep_bytes; the rest counted
     │        ──report pipe───▶ what a scorer's test bench says (at most REPORT_BYTES)
     ├─ each poll: stop? time limit? the workspace's entries and bytes within their quota?
     └─ it ends by itself │ time limit │ stop │ quota │ more printed than limits.output_bytes
                                    └──────────────── the group killed, every process in it
```

Memory stays flat whatever a command prints: output is read in chunks and only what is kept is
held. The quota is polled, at intervals growing from 10 to 250 ms (and keeping measurement under a
twentieth of the time), so a flood is stopped within one interval of crossing it (each file is
also capped by ``RLIMIT_FSIZE``); a command too quick for a poll is measured when it ends. This
module knows nothing of tools or scoring: it runs an argv.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import selectors
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from gyre_hpc.sandbox import untrusted
from gyre_hpc.sandbox.limits import Group

CHUNK = 1 << 16
REPORT_BYTES = 4 << 20
"""The most a report pipe is read; a bench reporting more is cut (its last lines are lost)."""
FIRST_POLL_S, POLL_S = 0.01, 0.25
"""The quota is first measured 10 ms in, then at intervals growing to 250 ms (or twenty times what
one measurement took): a flood is caught early, and a long command costs next to nothing."""
WAKE_S = 0.1
"""How often a wait wakes to see whether it was stopped."""


@dataclass(frozen=True)
class ProcessEnded:
    exit_code: int
    """The process's exit status; -9 when it was killed."""
    output: bytes
    """What was kept of stdout and stderr (with a line saying how much was cut from the middle)."""
    printed: int
    """Bytes printed in all."""
    timed_out: bool
    killed: str
    """Why the group was killed ("" when it ended by itself): time limit, stopped, quota, output."""
    report: bytes = b""


@dataclass(frozen=True)
class Quota:
    """The workspace a process may write, and how much it may hold."""

    workspace: Path
    max_entries: int
    max_bytes: int


T = TypeVar("T")


async def aside(fn: Callable[..., T], *args: object, **kw: object) -> T:
    """``fn(*args, **kw)`` in a thread of its own. Supervising a process takes as long as the process
    runs: held in the event loop's default executor (a handful of threads), a few long commands
    would keep the proxy's log writes, which run there, waiting for them — and the commands' model
    calls waiting for those writes."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: object, err: BaseException | None) -> None:
        if not done.done():
            done.set_exception(err) if err is not None else done.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result, err = fn(*args, **kw), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            result, err = None, e
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits for it any more
            loop.call_soon_threadsafe(settle, result, err)

    threading.Thread(target=work, name=f"gyre-{getattr(fn, '__name__', 'aside')}", daemon=True).start()
    return await done


def report_pipe() -> tuple[int, int]:
    """A pipe for a test bench's report: (read end, write end); the write end is above fd 9
    (``limits.JOIN`` puts the seccomp filter on 9) and is handed to the process only."""
    r, w = os.pipe()
    high = fcntl.fcntl(w, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(w)
    return r, high


def run(
    argv: list[str],
    popen: dict,
    *,
    group: Group,
    timeout_s: float,
    keep_bytes: int,
    quota: Quota | None = None,
    stop: threading.Event | None = None,
    report: tuple[int, int] | None = None,
    sink: BinaryIO | None = None,
    sink_bytes: int = 0,
) -> ProcessEnded:
    """Run ``argv`` (``popen``: env, cwd, user) to its end, as described above. ``report``: a
    ``report_pipe`` whose write end ``argv`` names; ``sink``: also write the first ``sink_bytes``
    of the output there (a log)."""
    extra = {"pass_fds": (report[1],)} if report else {}
    try:
        proc = subprocess.Popen(
            argv, **popen, **extra, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    finally:
        if report:
            os.close(report[1])
    assert proc.stdout is not None
    out = _Kept(keep_bytes)
    got = bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    if report:
        sel.register(report[0], selectors.EVENT_READ, "report")
    deadline = time.monotonic() + timeout_s
    next_check, interval = time.monotonic() + FIRST_POLL_S, FIRST_POLL_S
    killed = ""
    try:
        while True:
            now = time.monotonic()
            if not killed:
                if stop is not None and stop.is_set():
                    killed = "stopped"
                elif now >= deadline:
                    killed = "time limit"
                elif out.printed > group.limits.output_bytes:
                    killed = f"printed more than {group.limits.output_bytes >> 20} MiB"
                elif quota is not None and now >= next_check:
                    t0 = time.monotonic()
                    use = untrusted.usage(quota.workspace, quota.max_entries, quota.max_bytes)
                    spent = time.monotonic() - t0
                    interval = max(min(interval * 1.5, POLL_S), 20 * spent)
                    next_check = time.monotonic() + interval
                    if why := use.over(quota.max_entries, quota.max_bytes):
                        killed = f"the workspace went over its quota: {why}"
                if killed:
                    _kill(proc, group)
                    deadline = time.monotonic() + 5  # what is left to drain once all is dead
            if not sel.get_map():
                if proc.poll() is not None:
                    break
                if killed and time.monotonic() > deadline:
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=_wait(deadline, next_check, quota, stop))
                continue
            events = sel.select(timeout=_wait(deadline, next_check, quota, stop))
            if killed and not events and time.monotonic() > deadline:
                break
            for key, _ in events:
                chunk = os.read(key.fd, CHUNK)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                if key.data == "report":
                    got += chunk[: max(0, REPORT_BYTES - len(got))]
                    continue
                out.add(chunk)
                if sink is not None and sink_bytes > 0:
                    sink.write(chunk[:sink_bytes])
                    sink_bytes -= len(chunk)
    finally:
        sel.close()
        proc.stdout.close()
        if report:
            os.close(report[0])
        if proc.poll() is None:
            _kill(proc, group)
        proc.wait()
    return ProcessEnded(
        -9 if killed else proc.returncode, out.text(), out.printed, killed == "time limit", killed, bytes(got)
    )


def _wait(deadline: float, next_check: float, quota: Quota | None, stop: threading.Event | None) -> float:
    until = min(deadline, next_check) if quota is not None else deadline
    wait = max(0.0, until - time.monotonic())
    return min(wait, WAKE_S) if stop is not None else max(wait, 0.001)


def _kill(proc: subprocess.Popen, group: Group) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    group.kill()


class _Kept:
    """The first ¾ and the last ¼ of ``keep`` bytes of a stream, and how long it was."""

    def __init__(self, keep: int) -> None:
        self.head_max, self.tail_max = keep - keep // 4, keep // 4
        self.head = bytearray()
        self.tail: deque[bytes] = deque()
        self.tail_len = 0
        self.printed = 0

    def add(self, chunk: bytes) -> None:
        self.printed += len(chunk)
        room = self.head_max - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail_max > 0:
            self.tail.append(chunk)
            self.tail_len += len(chunk)
            while self.tail_len - len(self.tail[0]) >= self.tail_max:
                self.tail_len -= len(self.tail.popleft())

    def text(self) -> bytes:
        tail = b"".join(self.tail)[-self.tail_max :] if self.tail_max else b""
        cut = self.printed - len(self.head) - len(tail)
        if cut <= 0:
            return bytes(self.head) + tail
        return bytes(self.head) + f"\n[… {cut:,} bytes of output cut …]\n".encode() + tail
