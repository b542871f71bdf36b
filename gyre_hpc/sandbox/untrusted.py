"""Files the policy wrote, as the runtime touches them: never through a link, never blocking, bounded.

A workspace belongs to the policy. It may hold links to anywhere, FIFOs that block whoever opens
them, sockets and devices, directories nested far past any recursion limit, millions of entries,
files of any size. The runtime reads it (file tools, milestones), measures it (the workspace
quota), copies it (every scorer works on a copy) and removes it only through these functions:

- nothing here follows a link: a link is reported as a link, copied as a link, never opened;
- a file is opened ``O_NONBLOCK`` and used only if it is a regular file (a FIFO never blocks);
- every walk is iterative (no recursion limit to hit) and bounded in depth and entries;
- removal never follows a link, and a tree too deep to remove recursively goes to ``rm -rf``.

This module knows nothing of sandboxes, tasks or scoring: it is the file system, distrusted.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import stat
import subprocess
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PATH_MAX = 4096
"""Linux's limit on a path the kernel takes whole: a workspace may nest past it (the quota counts
what lies there, a copy leaves it out)."""
MAX_DEPTH = 64
"""Directories deeper than this below a workspace are neither listed nor copied."""
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class WalkEntry:
    rel: str
    """Path below the root, ``/``-separated."""
    kind: str
    """file | dir | link | other (a FIFO, socket or device)."""
    size: int
    depth: int


def walk(root: Path, max_depth: int = MAX_DEPTH, max_entries: int | None = None) -> Iterator[WalkEntry]:
    """Every entry below ``root``, breadth first, without following links; directories deeper than
    ``max_depth`` are not entered, and the walk stops after ``max_entries``. Paths past PATH_MAX
    are walked like any other (by directory fd); a directory that cannot be read is skipped."""
    count = 0
    queue: deque[tuple[str, int]] = deque([("", 1)])
    while queue:
        rel, depth = queue.popleft()
        fd = _open_dir(root, rel)
        if fd is None:
            continue
        try:
            with os.scandir(fd) as it:  # by fd: a path past PATH_MAX is listed like any other
                entries = sorted(it, key=lambda e: e.name)
            stats = []  # while ``fd`` is open: an entry listed by fd is stat'ed through it
            for e in entries:
                try:
                    stats.append((e, e.stat(follow_symlinks=False)))
                except OSError:
                    continue
        except OSError:
            continue
        finally:
            os.close(fd)
        for e, st in stats:
            kind = _kind(st.st_mode)
            sub = f"{rel}/{e.name}" if rel else e.name
            yield WalkEntry(sub, kind, st.st_size if kind == "file" else 0, depth)
            count += 1
            if max_entries is not None and count >= max_entries:
                return
            if kind == "dir" and depth < max_depth:
                queue.append((sub, depth + 1))


def _open_dir(root: Path, rel: str) -> int | None:
    """An fd of the directory ``root/rel``, never through a link; by its path when the kernel takes
    it, else component by component (a tree may nest past PATH_MAX, and its files still count)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        return os.open(root / rel, flags | os.O_NOFOLLOW) if rel else os.open(root, flags)
    except OSError as err:
        if err.errno != errno.ENAMETOOLONG:
            return None
    fd = _open_inside(root, rel)
    if fd is not None and not stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "dir"
    return "file" if stat.S_ISREG(mode) else "other"


@dataclass(frozen=True)
class Usage:
    entries: int
    bytes: int
    too_deep: bool = False
    """Directories nested past ``max_depth``: more than any workspace needs, counted as over quota."""

    def over(self, max_entries: int, max_bytes: int) -> str | None:
        """Why this usage breaks the quota, or None."""
        if self.too_deep:
            return f"directories nested deeper than {MAX_DEPTH * 4}"
        if self.entries > max_entries:
            return f"{self.entries:,} files and directories (at most {max_entries:,})"
        if self.bytes > max_bytes:
            return f"{self.bytes / 2**20:,.0f} MiB (at most {max_bytes / 2**20:,.0f} MiB)"
        return None


def usage(root: Path, stop_entries: int, stop_bytes: int) -> Usage:
    """How many entries and bytes ``root`` holds, counting stopped once past either bound (enough to
    know the quota is broken). Every depth counts: a deep directory cannot hide a flood."""
    entries = size = 0
    for e in walk(root, max_depth=MAX_DEPTH * 4):
        entries += 1
        size += e.size
        if e.kind == "dir" and e.depth >= MAX_DEPTH * 4:
            return Usage(entries, size, too_deep=True)
        if entries > stop_entries or size > stop_bytes:
            break
    return Usage(entries, size)


def _open_inside(root: Path, rel: str) -> int | None:
    """An fd of ``root/rel`` opened component by component, none of them a link; None if a
    component is missing, is a link, or the path leaves ``root``."""
    parts = [p for p in Path(rel).parts if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts) or Path(rel).is_absolute():
        return None
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for i, part in enumerate(parts):
            flags = _OPEN | (os.O_DIRECTORY if i < len(parts) - 1 else 0)
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except OSError:
                return None
            os.close(fd)
            fd = nxt
        out, fd = fd, -1
        return out
    finally:
        if fd >= 0:
            os.close(fd)


def exists(root: Path, rel: str) -> bool:
    """Whether ``rel`` is a file or directory inside ``root`` reached without any link."""
    fd = _open_inside(root, rel)
    if fd is None:
        return False
    os.close(fd)
    return True


def read(root: Path, rel: str, limit: int) -> bytes | None:
    """At most ``limit`` bytes of the regular file ``rel`` inside ``root``; None if it is absent,
    reached through a link, or not a regular file."""
    fd = _open_inside(root, rel)
    if fd is None:
        return None
    try:
        return read_fd(fd, limit)
    finally:
        os.close(fd)


def read_fd(fd: int, limit: int) -> bytes | None:
    """At most ``limit`` bytes from ``fd``, if it is a regular file."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return None
    chunks, left = [], limit
    while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def open_regular(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a path the runtime already resolved, refusing a link as its last component,
    never blocking on a FIFO, and only returning an fd of a regular file (else ``OSError``)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    os.set_blocking(fd, True)
    return fd


@dataclass
class Copied:
    entries: int = 0
    bytes: int = 0
    left_out: list[str] = field(default_factory=list)
    """What was not copied and why (the first few): special files, too deep, over the bounds."""

    def note(self, why: str) -> None:
        if len(self.left_out) < 8:
            self.left_out.append(why)


class OutOfTime(Exception):
    """A copy ran past its deadline (what was copied so far stays)."""


def copy_tree(
    src: Path,
    dst: Path,
    max_entries: int,
    max_bytes: int,
    owner: int | None = None,
    deadline: float = math.inf,
) -> Copied:
    """A copy of ``src`` at ``dst`` (created): directories, regular files (contents and permission
    bits, never set-id) and links (as links, unresolved); FIFOs, sockets and devices are left out,
    as is whatever lies deeper than ``MAX_DEPTH`` or past the bounds. Everything made belongs to
    ``owner`` when given. Past ``deadline`` (``time.monotonic``) it raises ``OutOfTime``."""
    done = Copied()
    dst.mkdir(mode=0o755)
    _own(dst, owner)
    for e in walk(src, MAX_DEPTH):
        if time.monotonic() > deadline:
            raise OutOfTime(f"{done.entries:,} entries copied")
        target = dst / e.rel
        if e.kind == "other":
            done.note(f"{e.rel}: not a regular file")
            continue
        if done.entries >= max_entries or done.bytes + e.size > max_bytes:
            done.note(f"{e.rel}: past the copy's bounds ({max_entries:,} entries, {max_bytes >> 20} MiB)")
            continue
        if len(os.fsencode(target)) >= PATH_MAX:
            done.note(f"{e.rel[:64]}…: a path longer than {PATH_MAX} bytes, left out of the copy")
            continue
        if not target.parent.is_dir() or target.parent.is_symlink():
            continue  # its directory was left out
        try:
            if e.kind == "dir":
                target.mkdir(mode=0o755)
            elif e.kind == "link":
                os.symlink(os.readlink(src / e.rel), target)
            elif not _copy_file(src / e.rel, target, max_bytes - done.bytes):
                done.note(f"{e.rel}: changed or unreadable while copied")
                continue
        except OSError as err:
            done.note(f"{e.rel}: {err.strerror or err}")
            continue
        _own(target, owner)
        done.entries += 1
        done.bytes += e.size
        if e.kind == "dir" and e.depth == MAX_DEPTH:
            done.note(f"{e.rel}: deeper than {MAX_DEPTH} directories, its contents left out")
    return done


def _copy_file(src: Path, dst: Path, limit: int) -> bool:
    try:
        fd = os.open(src, _OPEN)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return False
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            for start, end in _data_extents(fd, st.st_size):  # holes stay holes: a sparse file
                os.lseek(fd, start, os.SEEK_SET)  # costs its data, not its size, in every copy
                os.lseek(out, start, os.SEEK_SET)
                left = end - start
                while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                    os.write(out, chunk)
                    left -= len(chunk)
            os.ftruncate(out, st.st_size)
            os.fchmod(out, stat.S_IMODE(st.st_mode) & 0o777 | 0o600)
        finally:
            os.close(out)
        return True
    finally:
        os.close(fd)


def _data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """The ``[start, end)`` ranges of ``fd`` that hold data (``SEEK_DATA``/``SEEK_HOLE``); the
    whole file where the file system cannot tell."""
    at = 0
    while at < size:
        try:
            start = os.lseek(fd, at, os.SEEK_DATA)
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        except OSError as err:
            if err.errno == errno.ENXIO:  # nothing but a hole from here
                return
            yield at, size
            return
        if start >= size:
            return
        yield start, end
        at = end


def _own(path: Path, owner: int | None) -> None:
    if owner is not None:
        os.chown(path, owner, owner, follow_symlinks=False)


def own_tree(root: Path, owner: int) -> None:
    """Hand ``root`` and everything in it (to ``MAX_DEPTH``) to ``owner``, never through a link."""
    _own(root, owner)
    for e in walk(root, MAX_DEPTH):
        try:
            os.chown(root / e.rel, owner, owner, follow_symlinks=False)
        except OSError:
            continue


def place(root: Path, rel: str, data: bytes | None, owner: int | None = None) -> None:
    """Make ``root/rel`` a regular file holding ``data`` (absent if None), whatever the tree held
    there: a link or a file standing where a directory must be is removed, never followed. For a
    tree nothing else writes meanwhile (a scorer's fresh copy, before its sandbox starts)."""
    parts = [p for p in Path(rel).parts if p not in ("", ".")]
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise ValueError(f"{rel!r} is not a path inside the tree")
    at = root
    for part in parts[:-1]:
        at = at / part
        if os.path.islink(at) or (os.path.lexists(at) and not at.is_dir()):
            _unlink(at)
        if not os.path.lexists(at):
            at.mkdir(mode=0o755)
            _own(at, owner)
    target = at / parts[-1]
    if os.path.lexists(target):
        _unlink(target)
    if data is None:
        return
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    _own(target, owner)


def _unlink(path: Path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        remove(path)
    else:
        os.unlink(path)


def remove(path: Path) -> None:
    """Remove ``path`` and everything under it, at any depth, never through a link."""
    if not os.path.lexists(path):
        return
    try:
        shutil.rmtree(path)  # fd-based: never follows a link; recursive, so deep trees go to rm
    except (RecursionError, OSError):
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], check=False)
