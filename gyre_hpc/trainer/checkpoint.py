"""Checkpoints: a plain Hugging Face model directory plus what resuming needs.

```
 checkpoints/step-000012/
   config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja
   model.safetensors            ← a replica of one rank: the engines, SGLang and transformers load
                                  this directory as is
   or megatron/stage-<s>-tp-<t>.safetensors
                                ← a replica over ranks: each rank's slice, written by that rank
     (+ model-*.safetensors, model.safetensors.index.json at the steps trainer.export_every asks
        for, and by `gyre-hpc model export`: a Hugging Face model, written a bucket at a time)
   optimizer.pt                 ← AdamW state of the core's backend (another backend resumes the weights),
   or optimizer-rank-<r>.pt       one file per rank of a replica, each written by its rank
   state.json                   ← {"step": 12, "version": 12, "sha256": {file: digest, …}, …}
```

Written into a temporary directory and renamed, so a checkpoint is either complete or absent.
A file damaged afterwards (a truncated copy, a bad sector) fails its digest: ``newest_intact``
names it and falls back to the previous checkpoint, and the controller and the core, which both
call it, agree on which one that is.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre_hpc.diskspace import DiskFull, ensure_room, free_bytes, is_disk_full, message
from gyre_hpc.models.hf_files import copy_model_files, write_buckets
from gyre_hpc.rundir import (
    checkpoint_dir,
    checkpoint_dirs,
    checkpoint_recorded,
    checkpoint_shards,
    checkpoint_state,
)
from gyre_hpc.trainer import weight_shards
from gyre_hpc.trainer.base import Trainer
from gyre_hpc.trainer.state_files import sha256

log = logging.getLogger(__name__)

EXPORT_BUCKET = 2 << 30
"""Bytes a Hugging Face export writes a file at a time (and holds at most, with one tensor)."""


def save(
    root: Path, step: int, trainer: Trainer, model_dir: Path, written: Callable[[], None] = lambda: None,
    export: bool = False, **state: Any,
) -> Path:  # fmt: skip
    """Write the checkpoint of ``step``; ``DiskFull`` (naming the directory and what is free)
    before it starts when it would not fit, or when the disk fills while it is written.
    ``written`` is called once its files are written, before they are renamed in place.
    ``export``: shards are also written as a Hugging Face model beside them (``export``)."""
    final, tmp = checkpoint_dir(root, step), checkpoint_dir(root, step, writing=True)
    shutil.rmtree(tmp, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    ensure_room(root, expected_size(root, trainer.numel, model_dir))
    try:
        copy_model_files(model_dir, tmp)
        digests = {**trainer.save_weights(tmp), **trainer.save_optimizer(tmp)}
        if export and checkpoint_shards(tmp):
            digests |= export_hf(tmp, tmp)
        checkpoint_state(tmp).write_text(
            json.dumps({"step": step, "version": trainer.version, "sha256": digests, **state}) + "\n"
        )
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)  # a checkpoint is complete or absent, never half there
        if is_disk_full(err):  # torch's zip writer says only "unexpected pos …"
            raise DiskFull(message(root, free_bytes(root))) from err
        raise
    written()
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def expected_size(root: Path, numel: int, model_dir: Path) -> int:
    """Bytes the next checkpoint takes: the newest one's size, or before the first, float32
    weights and AdamW's two moments (12 bytes a parameter) and the model directory's other files."""
    newest = next(iter(checkpoint_dirs(root)), None)
    if newest is not None:
        return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    files = [f for f in model_dir.iterdir() if f.is_file() and f.name != "model.safetensors"]
    return 12 * numel + sum(f.stat().st_size for f in files)


def damage(path: Path) -> str | None:
    """What is wrong with the checkpoint at ``path`` (one line naming the file), or None."""
    try:
        state = read_state(path)
    except (OSError, ValueError) as err:
        return f"{checkpoint_state(path)}: unreadable ({err})"
    for name, want in state.get("sha256", {}).items():  # checkpoints written before digests: trusted
        try:
            got = sha256(path / name)
        except OSError as err:
            return f"{path / name}: unreadable ({err.strerror or err})"
        if got != want:
            state_name = checkpoint_state(path).name
            return f"{path / name}: damaged (sha256 {got[:12]}…, {state_name} says {want[:12]}…)"
    if state.get("awaits_record") and not checkpoint_recorded(path).exists():
        return f"{path}: its step was never recorded (the run stopped first): the step runs again"
    return None


def newest_intact(root: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint whose files match their digests, and what was wrong with each newer one."""
    skipped: list[str] = []
    for path in checkpoint_dirs(root):
        problem = damage(path)
        if problem is None:
            return path, skipped
        log.warning("checkpoint skipped: %s", problem)
        skipped.append(problem)
    return None, skipped


def read_state(path: Path) -> dict[str, Any]:
    return json.loads(checkpoint_state(path).read_text())


def read_weights(path: Path) -> np.ndarray:
    """A checkpoint's weights as one flat float32 buffer (``models.flat`` order), however written."""
    return weight_shards.read_flat(path)


def export_hf(
    path: Path, out: Path, bucket_bytes: int = EXPORT_BUCKET, dtype: torch.dtype | None = None,
    advanced: Callable[[], None] = lambda: None,
) -> dict[str, str]:  # fmt: skip
    """A checkpoint (shards or whole) as a Hugging Face model directory ``out``, written a bucket
    at a time from its shards (no whole model in memory): the weight files' names → sha256.
    ``advanced`` is called after each tensor."""
    copy_model_files(path, out)

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for item in weight_shards.hf_tensors(path):
            yield item
            advanced()

    names = write_buckets(counted(), out, bucket_bytes, dtype)
    return {name: sha256(out / name) for name in names}


def restore(path: Path, trainer: Trainer) -> dict[str, Any]:
    """Weights and optimizer state into ``trainer``: each of its ranks reads its own slice
    (resharded when another layout wrote them), any backend."""
    info = read_state(path)
    trainer.load_weights(path, int(info["version"]))
    try:  # into host memory: the trainer moves it to its device when its GPU is its own
        trainer.load_optimizer(path)
    except (ValueError, KeyError, FileNotFoundError) as err:  # another backend or replica shape
        log.warning("%s: optimizer state does not fit this trainer (%s); AdamW starts afresh", path, err)
    return info
