"""Checkpoints: a plain Hugging Face model directory plus what resuming needs.

```
 checkpoints/step-000012/
   config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja
   model.safetensors            ← the engines, SGLang and transformers load this directory as is
   optimizer.pt                 ← AdamW state (the core's only)
   state.json                   ← {"step": 12, "version": 12}
```

Written into a temporary directory and renamed, so a checkpoint is either complete or absent.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from gyre_hpc.models.tiny import save_weights
from gyre_hpc.trainer.torch_backend import TorchTrainer

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def save(root: Path, step: int, trainer: TorchTrainer, model_dir: Path, **state: Any) -> Path:
    final = step_dir(root, step)
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in MODEL_FILES:
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, tmp / name)
    save_weights(trainer.model, tmp / "model.safetensors")
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


def restore(path: Path, trainer: TorchTrainer) -> dict[str, Any]:
    """Weights and optimizer state into ``trainer`` (in place: parameter views stay valid)."""
    state = load_file(str(path / "model.safetensors"))
    if trainer.model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.no_grad():
        trainer.model.load_state_dict(state, strict=False)
    trainer.load_optimizer_state(torch.load(path / "optimizer.pt", weights_only=True))
    info = read_state(path)
    trainer.version = int(info["version"])
    return info
