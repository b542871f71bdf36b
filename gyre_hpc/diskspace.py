"""A full disk, named: checked before a large write whose size is known, recognised after a
write that failed for want of space (torch's zip writer says only ``unexpected pos …``), and never
a record written half in silence (``write_all``).

It knows nothing of checkpoints: callers give the path and the bytes they are about to write.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from gyre_hpc.errors import GyreError

MIB = 1 << 20
MARGIN = 1.05
"""Room asked beyond the estimate: file-system blocks and metadata."""


class DiskFull(GyreError):
    """There is no room for a write; the message names the directory and what is free."""


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system (its nearest
    existing ancestor's)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def message(where: Path, free: int, needed: int | None = None) -> str:
    need = f"; the write needs {needed / MIB:.0f} MiB" if needed else ""
    return f"no space left on device under {where} ({free / MIB:.0f} MiB free{need})"


def ensure_room(where: Path, needed: int) -> None:
    """Raise ``DiskFull`` unless ``needed`` bytes (and a margin) fit under ``where``."""
    free = free_bytes(where)
    if free < needed * MARGIN:
        raise DiskFull(message(where, free, needed))


def write_all(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd``, or an ``OSError``. A write that fills the disk midway returns
    short without an error: the next one says ENOSPC. A record must not be left torn in silence,
    with the next one glued to it."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is a write that ran out of space."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiskFull) or (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)):
            return True
        text = str(e)
        # torch's zip writer says "unexpected pos", or its stream's "basic_ios::clear" once a
        # write failed (the optimizer state's torch.save on a full disk)
        if "No space left on device" in text or "unexpected pos" in text or "basic_ios::clear" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def describe(err: BaseException, where: Path) -> str:
    """``err`` on one line, as a rank reports why it failed; a write that ran out of space (any
    writer's: the event log, a log, a checkpoint) names the disk and what is left on it."""
    plain = f"{type(err).__name__}: {err}"
    if isinstance(err, DiskFull) or not is_disk_full(err):
        return plain
    try:
        return f"DiskFull: {message(where, free_bytes(where))} ({plain})"
    except OSError:  # on the way down: the reason as it came is better than none
        return plain
