"""A full disk is named: checked before a checkpoint is written, recognised when a write runs out
of room (torch's zip writer says only ``unexpected pos``), and no ``--resume`` is suggested that
would fail the same way. The disk is a real tmpfs, small on purpose."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import gyre

from gyre_hpc.agents.journal import Journal
from gyre_hpc.diskspace import DiskFull, describe, ensure_room, free_bytes, is_disk_full, message
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.observability import events as ev
from gyre_hpc.observability.events import EventLog, read_events
from gyre_hpc.observability.tracking import TensorBoard, Trackers
from gyre_hpc.proxy.server import ChatIndex
from gyre_hpc.proxy.tito_log import TitoLog
from gyre_hpc.recipe.schema import TrainerConfig
from gyre_hpc.trainer import checkpoint
from gyre_hpc.trainer.torch_backend import TorchTrainer
from gyre_hpc.trajectory.codec import read_records
from gyre_hpc.trajectory.records import TitoRecord

ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 6 MiB tmpfs: room for a run's first step, not for the tiny model's checkpoint."""
    where = tmp_path / "disk"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_what_counts_as_a_full_disk() -> None:
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    wrapped = RuntimeError("writing failed")
    wrapped.__cause__ = RuntimeError(
        "[enforce fail at inline_container.cc:664] . unexpected pos 1920896 vs 1920784"
    )
    assert is_disk_full(wrapped)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(ValueError("unexpected token"))


def test_a_rank_that_ran_out_of_space_names_the_disk_whoever_wrote(tmp_path: Path) -> None:
    """The event log or a rank's log hits the full disk before any checkpoint check can: the
    rank's reason names the disk all the same, and any other error reads as it came."""
    said = describe(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert said.startswith(f"DiskFull: no space left on device under {tmp_path} (") and "MiB free" in said
    assert said.endswith("(OSError: [Errno 28] No space left on device)")
    assert describe(ValueError("bad token"), tmp_path) == "ValueError: bad token"
    full = DiskFull(message(tmp_path, 0, 10 << 20))
    assert describe(full, tmp_path) == f"DiskFull: {full}"  # already named: not twice


@pytest.mark.root
def test_a_checkpoint_that_cannot_fit_is_refused_before_a_byte_is_written(
    small_disk: Path, tmp_path: Path
) -> None:
    tiny = init_tiny(tmp_path / "tiny", seed=0)
    trainer = TorchTrainer(tiny, TrainerConfig(), core=True)
    with pytest.raises(
        DiskFull,
        match=rf"no space left on device under {small_disk}/ckpt \(\d MiB free; the write needs \d+ MiB\)",
    ):
        checkpoint.save(small_disk / "ckpt", 1, trainer, tiny)
    assert list((small_disk / "ckpt").iterdir()) == []  # nothing half written
    with pytest.raises(DiskFull):
        ensure_room(small_disk, free_bytes(small_disk) + 1)


@pytest.mark.root
def test_torch_s_zip_writer_on_a_full_disk_is_recognised(small_disk: Path) -> None:
    with pytest.raises(RuntimeError) as err:
        torch.save(torch.zeros(4 << 20), small_disk / "big.pt")  # 16 MiB into 6
    assert is_disk_full(err.value), str(err.value)


@pytest.mark.root
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_a_run_on_a_full_disk_names_it_and_does_not_suggest_a_resume_that_would_fail(
    small_disk: Path,
) -> None:
    proc = gyre(
        "run", "recipes/smoke.toml",
        "--set", f"run.runs_dir={small_disk / 'runs'}", "--set", "run.model=tiny", "--set", "run.steps=1",
        "--set", "tasks.prompts_per_step=2", "--set", "tasks.eval_every=0",
        "--set", "trainer.checkpoint_every=1",
        timeout=600, env={**os.environ, **ROOT_OK},
    )  # fmt: skip
    assert proc.returncode == 1
    (run,) = (small_disk / "runs").iterdir()
    assert f"no space left on device under {run}/checkpoints (" in proc.stderr
    assert "--resume" not in proc.stderr and "not resumable yet" in proc.stderr
    assert "unexpected pos" not in proc.stderr and "Traceback" not in proc.stderr


def fill(disk: Path) -> None:
    """Nothing left on ``disk`` (a file already there may still finish the page it has begun)."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * (1 << 16))
    except OSError as err:
        assert err.errno == errno.ENOSPC
    finally:
        os.close(fd)


BIG = "x" * 20_000
"""A record of several pages: written into a full disk, its first bytes fit the page its file
has begun and the write returns short, with no error (the rest fails on the next write)."""


def tito(disk: Path) -> tuple[Callable[[], None], Callable[[], int]]:
    log = TitoLog(disk / "tito.bin")
    ids = np.arange(5, dtype=np.int32)

    def append(n: int) -> None:
        record = TitoRecord("r", f"c{n}", "main", ids, np.arange(n, dtype=np.int32), np.zeros(n, np.float32))
        asyncio.run(log.append(record))

    append(4)

    def write() -> None:
        try:
            append(10_000)
        finally:  # and the log takes nothing more: its tree is ahead of its file
            with pytest.raises(OSError):
                append(4)

    return write, lambda: len(read_records(disk / "tito.bin").records)


def events(disk: Path) -> tuple[Callable[[], None], Callable[[], int]]:
    log = EventLog(disk / "events.jsonl")
    log.emit(ev.RunEnd(status="running"))
    return lambda: log.emit(ev.RankFailed(rank=1, task=1, cell=0, host="h", error=BIG)), lambda: len(
        read_events(disk / "events.jsonl")
    )


def journal(disk: Path) -> tuple[Callable[[], None], Callable[[], int]]:
    j = Journal(disk / "journal")
    j.call("r", 0, [{"role": "user", "content": "spec"}], 1, {}, 1.0)

    def kept() -> int:
        entry = j.load("r")
        return 0 if entry is None else entry.calls

    return lambda: j.call("r", 1, [{"role": "assistant", "content": BIG}], 2, {}, 2.0), kept


def chats(disk: Path) -> tuple[Callable[[], None], Callable[[], int]]:
    index = ChatIndex(disk / "chats.jsonl")
    index.append("r", {"record": 0, "text": "a"})
    path = disk / "chats.jsonl"

    def whole() -> int:  # as ChatIndex reads it (opening one to read would write to the full disk)
        lines = path.read_bytes().splitlines(keepends=True)
        return sum(line.endswith(b"\n") and b'"record"' in line for line in lines)

    return lambda: index.append("r", {"record": 1, "text": BIG}), whole


@pytest.mark.root
@pytest.mark.parametrize("writer", [tito, events, journal, chats], ids=lambda w: w.__name__)
def test_each_writer_on_a_full_disk_fails_naming_it_and_keeps_every_whole_record(
    small_disk: Path, writer: Callable[[Path], tuple[Callable[[], None], Callable[[], int]]]
) -> None:
    """The TITO log, the event log, an execution's journal and the chat index, each with one
    record written, then a disk with nothing left: a record of several pages fails with ENOSPC
    (a write that returns short is not taken for a whole one), the reason names the disk, and the
    file reads back as the one whole record it had (no torn record glued to the next)."""
    write, whole = writer(small_disk)
    fill(small_disk)
    with pytest.raises(OSError) as err:
        write()
    said = describe(err.value, small_disk)
    assert said.startswith(f"DiskFull: no space left on device under {small_disk} ("), said
    assert whole() == 1


@pytest.mark.root
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # its writer thread
def test_tensorboard_on_a_full_disk_is_dropped_with_a_line_naming_it(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tracker never stops training: on a full disk TensorBoard is dropped, and the warning
    names the disk (the event log, on the run's disk, ends the run if it is full there too)."""
    trackers = Trackers([TensorBoard(small_disk / "tensorboard")])
    step = ev.Step(step=1, version=1, seconds=1.0, sample_seconds=1.0, roles={})
    trackers.record(step)
    fill(small_disk)
    with caplog.at_level(logging.WARNING):
        for n in range(2, 200):  # the writer's buffer takes a few steps before it meets the disk
            trackers.record(replace(step, step=n, token_stats={f"k{i}": float(i) for i in range(64)}))
            if not trackers.writers:
                break
    assert not trackers.writers
    (line,) = [r.getMessage() for r in caplog.records if "tracker" in r.getMessage()]
    assert (
        f"TensorBoard failed, dropped: DiskFull: no space left on device under {small_disk}/tensorboard ("
        in line
    )
