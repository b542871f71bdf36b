"""Only the processes a rule allows may open some files, whatever path they take to them: fanotify
permission events on the files' inodes.

```
 open(file) by any process, by any name or link ─▶ the kernel holds the open
   ─▶ the guard's thread: allowed(pid)? ─▶ ALLOW, or DENY (the open fails with EPERM)
 close() ─▶ no more marks; an open still held is allowed
```

Needs ``CAP_SYS_ADMIN`` (the runtime as root): ``OpenGuard.start`` returns None where the kernel
or the runtime cannot (the caller says what it does then). Only opens are held: a process that
already holds the file open, ``truncate(2)`` by path, or a rename over the name are not — the caller
makes the files so that none of those can happen (owned by root, in a sticky directory, created
before anything runs).

What it does not know: which process is which; the rule decides from the pid, while the opening
process waits, so the pid is still the opener's.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
from collections.abc import Callable
from pathlib import Path

FAN_CLOEXEC, FAN_CLASS_CONTENT = 0x01, 0x04
FAN_MARK_ADD = 0x01
FAN_OPEN_PERM = 0x00010000
FAN_ALLOW, FAN_DENY = 0x01, 0x02
AT_FDCWD = -100
_META = struct.Struct("=IBBHQii")
"""struct fanotify_event_metadata: event_len, vers, reserved, metadata_len, mask, fd, pid."""
_RESPONSE = struct.Struct("=iI")


class OpenGuard:
    """A running guard over some files; ``denied`` lists (pid, path) of the opens it refused."""

    def __init__(self, fd: int, allowed: Callable[[int], bool]) -> None:
        self.fd = fd
        self.allowed = allowed
        self.denied: list[tuple[int, str]] = []
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="open-guard", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, files: list[Path], allowed: Callable[[int], bool]) -> OpenGuard | None:
        """A guard over ``files`` (which exist), or None where fanotify permission events are not
        to be had (not root, or a kernel without them)."""
        libc = ctypes.CDLL(None, use_errno=True)
        c = ctypes
        libc.fanotify_mark.argtypes = [c.c_int, c.c_uint, c.c_uint64, c.c_int, c.c_char_p]
        fd = libc.fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC, os.O_RDONLY | os.O_LARGEFILE)
        if fd < 0:
            return None
        for path in files:
            if libc.fanotify_mark(fd, FAN_MARK_ADD, FAN_OPEN_PERM, AT_FDCWD, os.fsencode(path)) != 0:
                os.close(fd)
                return None
        return cls(fd, allowed)

    def _serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.fd, self._wake_r], [], [])
            if self._wake_r in ready:
                return
            try:
                data = os.read(self.fd, 64 * _META.size)
            except OSError:
                return
            at = 0
            while at + _META.size <= len(data):
                length, _, _, _, _, event_fd, pid = _META.unpack_from(data, at)
                at += max(length, _META.size)
                if event_fd < 0:
                    continue
                try:
                    ok = bool(self.allowed(pid))
                except Exception:  # noqa: BLE001 - a rule that cannot tell refuses
                    ok = False
                if not ok:
                    self.denied.append((pid, _name(event_fd)))
                try:
                    os.write(self.fd, _RESPONSE.pack(event_fd, FAN_ALLOW if ok else FAN_DENY))
                finally:
                    os.close(event_fd)

    def close(self) -> None:
        os.write(self._wake_w, b"x")
        self._thread.join()
        for fd in (self.fd, self._wake_r, self._wake_w):
            os.close(fd)


def _name(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def ns_pid(pid: int) -> tuple[int, int]:
    """(the pid in its innermost pid namespace, how many namespaces deep it is) of ``pid``, a pid
    of ours; (0, 0) when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                ids = line.split()[1:]
                return int(ids[-1]), len(ids)
    except (OSError, ValueError, IndexError):
        pass
    return 0, 0


def parent(pid: int) -> int:
    """The parent of ``pid`` (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0
