"""A Hugging Face model directory's files: which hold its weights, and writing them from a stream
of tensors one bucket at a time.

```
 (name, tensor) (name, tensor) … ──▶ bucket 1 (≤ bucket_bytes) ──▶ model-00001-of-0000n.safetensors
                                     bucket 2                  ──▶ model-00002-of-0000n.safetensors
                                     …                              model.safetensors.index.json
 (all in one bucket: model.safetensors, no index: what transformers and SGLang write and read)
```

A writer holds one bucket and the tensor being added; it knows nothing of where the tensors
come from (a checkpoint's shards, a trainer's buffer).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

WEIGHTS = "model.safetensors"
"""A model's weights in one file (no index)."""
INDEX = "model.safetensors.index.json"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
"""What a model directory holds besides its weights."""


def copy_model_files(model_dir: Path, out: Path) -> None:
    """``model_dir``'s config, tokenizer and chat template into ``out`` (what is not its weights)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (model_dir / name).exists() and not (out / name).exists():
            shutil.copy2(model_dir / name, out / name)


def hf_weight_files(directory: Path) -> list[Path]:
    """The files that hold a model directory's weights: its index's, or its top-level
    ``*.safetensors`` (a checkpoint's shards, in a folder of their own, are not among them)."""
    index = directory / INDEX
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    return sorted(directory.glob("*.safetensors"))


def write_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out: Path,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """The tensors as Hugging Face weight files in ``out``, each bucket written as it fills
    (in ``dtype`` when given): the names of the files written, index included."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    bucket: dict[str, torch.Tensor] = {}
    size, where = 0, {}

    def flush() -> None:
        nonlocal bucket, size
        if bucket:
            path = out / f".bucket-{len(written):05d}.safetensors"
            save_file(bucket, str(path), {"format": "pt"})
            written.append(path)
            where.update(dict.fromkeys(bucket, len(written) - 1))
        bucket, size = {}, 0

    total = 0
    for name, t in tensors:
        t = (t.to(dtype) if dtype is not None else t).detach().cpu().contiguous()
        if bucket and size + t.nbytes > bucket_bytes:
            flush()
        bucket[name] = t
        size += t.nbytes
        total += t.nbytes
    flush()
    if len(written) == 1:
        written[0].rename(out / WEIGHTS)
        return [WEIGHTS]
    names = [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
    for path, name in zip(written, names, strict=True):
        path.rename(out / name)
    weight_map = {tensor: names[i] for tensor, i in where.items()}
    (out / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    return [*names, INDEX]
