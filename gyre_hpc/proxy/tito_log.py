"""The TITO log writer: every model call, delta-encoded per run, appended with group commit.

Each call is encoded against its run's trajectory tree (``trajectory.codec`` frames), queued,
and written in one ``write`` + ``fsync`` together with every call that arrived while the
previous write was under way (group commit: no added wait when idle, batches under load). The
proxy answers the harness only once its call is on disk, so nothing acknowledged is ever lost.
Where a write and its fsync take under ``INLINE_S`` (a local disk: ~0.1 ms) they run on the
event loop: handing them to a thread would cost more than they do. Slower storage (a network
file system) is written from a thread, so the loop keeps serving meanwhile; each write's time
decides where the next one runs.
Opening an existing log rebuilds the runs' trees and cuts off a torn tail.

``TitoTail`` is the reading side, for a process that does not write the log: the controller
when the proxy is several worker processes, each appending its own segment. It reads the
complete frames each segment has grown by since it last looked; a frame still being written is
read the next time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from gyre_hpc.diskspace import write_all
from gyre_hpc.trajectory.codec import by_run, encode_frame, read_frames, read_records
from gyre_hpc.trajectory.records import TitoRecord
from gyre_hpc.trajectory.tree import TrajectoryTree

INLINE_S = 0.001


class TitoLog:
    def __init__(self, path: str | Path, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.trees: dict[str, TrajectoryTree] = {}
        if self.path.exists():
            read = read_records(self.path)
            self.trees = {run: TrajectoryTree.from_encoded(recs) for run, recs in by_run(read.records)}
            if read.torn_bytes:
                with self.path.open("r+b") as fh:
                    fh.truncate(self.path.stat().st_size - read.torn_bytes)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._pending: list[tuple[bytes, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._inline = True
        self.frames_written = 0
        self.flushes = 0
        self.broken: OSError | None = None
        """The write that failed (a full disk): the trees hold records the file does not, so
        nothing more is written; the process fails, and a restart reads the file as it is."""
        self.failed = asyncio.Event()
        """Set with ``broken``, for whoever ends the process."""

    def tree(self, run_id: str) -> TrajectoryTree:
        if run_id not in self.trees:
            self.trees[run_id] = TrajectoryTree(run_id)
        return self.trees[run_id]

    async def append(self, record: TitoRecord) -> int:
        """Encode and queue ``record``; returns its index in its run once it is on disk."""
        if self.broken is not None:
            raise self.broken
        enc = self.tree(record.run_id).add(record)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((encode_frame(enc), fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        await fut
        return enc.index

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            data = b"".join(frame for frame, _ in batch)
            try:
                took = self._write(data) if self._inline else await asyncio.to_thread(self._write, data)
                self._inline = took < INLINE_S
            except OSError as err:
                self.broken = err
                self.failed.set()
                for _, fut in batch + self._pending:
                    fut.set_exception(err)
                self._pending = []
                return
            self.frames_written += len(batch)
            self.flushes += 1
            for _, fut in batch:
                if not fut.done():
                    fut.set_result(None)

    def _write(self, data: bytes) -> float:
        """Write and sync; the seconds it took. A write that fails leaves the file as it was (a
        frame cut short would hide every frame after it)."""
        started = time.perf_counter()
        size = os.fstat(self._fd).st_size
        try:
            write_all(self._fd, data)
            if self.fsync:
                os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)
            raise
        return time.perf_counter() - started

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class TitoTail:
    """The runs' trees, read from the segments ``segments()`` names as they grow."""

    def __init__(self, segments: Callable[[], list[Path]]) -> None:
        self.segments = segments
        self.trees: dict[str, TrajectoryTree] = {}
        self._read: dict[Path, int] = {}

    def update(self) -> dict[str, TrajectoryTree]:
        """Take in what the segments hold now; every call answered so far is in them."""
        for path in self.segments():
            at = self._read.get(path, 0)
            try:
                with path.open("rb") as fh:
                    fh.seek(at)
                    data = fh.read()
            except FileNotFoundError:
                continue
            got = read_frames(data)
            for enc in got.records:
                self.trees.setdefault(enc.run_id, TrajectoryTree(enc.run_id)).add_encoded(enc)
            self._read[path] = at + len(data) - got.torn_bytes
        return self.trees
