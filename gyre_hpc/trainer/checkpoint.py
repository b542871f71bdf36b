"""Checkpoints: a plain Hugging Face model directory plus what resuming needs.

```
 checkpoints/step-000012/
   config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja
   model.safetensors            ← the engines, SGLang and transformers load this directory as is
   optimizer.pt                 ← AdamW state of the core's backend (another backend resumes the weights)
   state.json                   ← {"step": 12, "version": 12}
```

Written into a temporary directory and renamed, so a checkpoint is either complete or absent.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from gyre_hpc.models.flat import FlatLayout
from gyre_hpc.models.qwen3 import Qwen3Config
from gyre_hpc.trainer.base import Trainer

log = logging.getLogger(__name__)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def save(root: Path, step: int, trainer: Trainer, model_dir: Path, **state: Any) -> Path:
    final = step_dir(root, step)
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    FlatLayout.of(Qwen3Config.load(model_dir)).save(trainer.weights(), model_dir, tmp)  # any backend
    torch.save(trainer.optimizer_state(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "version": trainer.version, **state}) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def latest(root: Path) -> Path | None:
    done = sorted(p for p in root.glob("step-*") if (p / "state.json").exists())
    return done[-1] if done else None


def read_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "state.json").read_text())


def restore(path: Path, trainer: Trainer) -> dict[str, Any]:
    """Weights and optimizer state into ``trainer`` (through its flat buffer, any backend)."""
    state = load_file(str(path / "model.safetensors"))
    flat = np.empty(trainer.numel, dtype=np.float32)
    for name, view in FlatLayout.of(Qwen3Config.load(path)).views(flat).items():
        view.copy_(state[name])
    info = read_state(path)
    trainer.load_snapshot(flat, int(info["version"]))
    try:
        trainer.load_optimizer_state(torch.load(path / "optimizer.pt", weights_only=True))
    except (ValueError, KeyError) as err:  # another backend or replica shape: cut differently
        log.warning("%s: optimizer state does not fit this trainer (%s); AdamW starts afresh", path, err)
    return info
