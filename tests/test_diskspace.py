"""A full disk is named: checked before a checkpoint is written, recognised when a write runs out
of room (torch's zip writer says only ``unexpected pos``), and no ``--resume`` is suggested that
would fail the same way. The disk is a real tmpfs, small on purpose."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import gyre

from gyre_hpc.diskspace import DiskFull, describe, ensure_room, free_bytes, is_disk_full, message
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.recipe.schema import TrainerConfig
from gyre_hpc.trainer import checkpoint
from gyre_hpc.trainer.torch_backend import TorchTrainer

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
