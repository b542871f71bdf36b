"""A checkpoint's weights as its ranks hold them, and the Hugging Face model read back from them
one tensor at a time.

```
 a replica of one rank (torch, or megatron at tp = pp = 1): model.safetensors       (write_whole)
 a replica over ranks: megatron/stage-<s>-tp-<t>.safetensors, each written by that rank of the
   first data-parallel replica, in Megatron's names, {tp, pp, ep, stage, tp_rank} in its metadata;
   with experts split (ep > 1) they are not in it but in megatron/stage-<s>-ep-<e>.safetensors,
   each written by the first rank that holds expert-parallel rank e's experts
        │ hf_tensors(path): megatron_to_hf over each stage, the TP (or EP) shards of a tensor joined
        ▼
 (HF name, tensor) … stage by stage ──▶ a flat buffer (read_flat), a Hugging Face export
                                        (models.hf_files), or another layout's slice (HFReader)
```

No file holds the whole model unless one rank did; no reader holds more than a tensor's shards
and what a stage's order puts before the tensor it was asked for. It knows the files and the
layout arithmetic, not who writes them nor which device the tensors came from.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.flat import FlatLayout, joined
from gyre_hpc.models.hf_files import hf_weight_files
from gyre_hpc.rundir import (
    checkpoint_expert_shard,
    checkpoint_expert_shards,
    checkpoint_shard,
    checkpoint_shards,
)
from gyre_hpc.trainer.megatron_weights import MegatronLayout, is_expert, megatron_to_hf
from gyre_hpc.trainer.state_files import sha256


def write_whole(layout: FlatLayout, flat: np.ndarray, directory: Path) -> dict[str, str]:
    """A whole model's flat buffer as Hugging Face's one weights file: its name → sha256."""
    path = layout.save_weights(flat, directory)
    return {path.name: sha256(path)}


def write_shard(
    directory: Path, tensors: dict[str, torch.Tensor], layout: MegatronLayout, stage: int, tp_rank: int,
    expert_rank: int | None = None,
) -> dict[str, str]:  # fmt: skip
    """One rank's tensors (Megatron's stage-local names) as its shard, or with ``expert_rank``
    as the expert shard of that expert-parallel rank: its name → sha256."""
    if expert_rank is None:
        path = checkpoint_shard(directory, stage, tp_rank)
    else:
        path = checkpoint_expert_shard(directory, stage, expert_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "stage": stage, "tp_rank": tp_rank,
            "vocab_multiple": layout.vocab_multiple}  # fmt: skip
    save_file(
        {n: t.contiguous() for n, t in tensors.items()}, str(path), {k: str(v) for k, v in meta.items()}
    )
    return {str(path.relative_to(directory)): sha256(path)}


def layout_of(directory: Path, config: ModelConfig) -> MegatronLayout | None:
    """The layout a checkpoint's shards were written in; None for a checkpoint written whole.
    ``ValueError`` naming what is missing when the shards do not cover a TP × PP grid."""
    shards = checkpoint_shards(directory)
    if not shards:
        return None
    with safe_open(next(iter(shards.values())), framework="pt") as h:
        meta = h.metadata() or {}
    try:
        tp, pp, multiple = int(meta["tp"]), int(meta["pp"]), int(meta["vocab_multiple"])
        ep = int(meta.get("ep", 1))
    except (KeyError, ValueError) as err:
        raise ValueError(f"{directory}: a weight shard without its layout ({err})") from err
    missing = sorted({(s, t) for s in range(pp) for t in range(tp)} - set(shards))
    if missing or len(shards) != tp * pp:
        raise ValueError(f"{directory}: weight shards of tp {tp} × pp {pp}, missing (stage, tp) {missing}")
    experts = checkpoint_expert_shards(directory) if ep > 1 else {}
    missing = sorted({(s, e) for s in range(pp) for e in range(ep)} - set(experts)) if ep > 1 else []
    if missing:
        raise ValueError(f"{directory}: expert shards of ep {ep} × pp {pp}, missing (stage, ep) {missing}")
    return MegatronLayout(config, tp=tp, pp=pp, ep=ep, vocab_multiple=multiple)


def other_layout(directory: Path, layout: MegatronLayout) -> str | None:
    """Why state kept per rank in ``directory`` (its optimizer's) is not ``layout``'s to load, in
    one line; None when its weights were written in ``layout``, or whole (a checkpoint from before
    shards: its ranks' files are as many as this replica's, which the caller checks)."""
    written = layout_of(directory, layout.config)
    if written is None:
        return None
    if not same_cut(written, layout):
        was, now = _cut(written), _cut(layout)
        return f"{directory}: written by {was}, not this {now}"
    return None


def _cut(layout: MegatronLayout) -> str:
    return f"tp {layout.tp} × pp {layout.pp}" + (f" × ep {layout.ep}" if layout.ep > 1 else "")


def same_cut(a: MegatronLayout, b: MegatronLayout) -> bool:
    """Whether two layouts cut every tensor alike (each rank's shard of one is its shard of the other)."""
    return (a.tp, a.pp, a.ep, a.vocab_multiple) == (b.tp, b.pp, b.ep, b.vocab_multiple)


def stage_tensors(directory: Path, layout: MegatronLayout, stage: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Stage ``stage``'s Hugging Face tensors, each joined from its TP (or EP) shards as it is read."""
    shards, experts = checkpoint_shards(directory), checkpoint_expert_shards(directory)
    handles = [safe_open(shards[stage, t], framework="pt") for t in range(layout.tp)]
    if layout.ep > 1:
        by_expert = [safe_open(experts[stage, e], framework="pt") for e in range(layout.ep)]

    def read(name: str) -> list[torch.Tensor]:
        return [h.get_tensor(name) for h in (by_expert if layout.ep > 1 and is_expert(name) else handles)]

    yield from megatron_to_hf(read, layout, stage)


def hf_tensors(directory: Path, config: ModelConfig | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every Hugging Face tensor of a checkpoint (shards or whole) or model directory, one at a
    time, as a checkpoint names it (fused experts one tensor an expert)."""
    config = config or ModelConfig.load(directory)
    layout = layout_of(directory, config)
    if layout is None:
        for f in hf_weight_files(directory):
            with safe_open(f, framework="pt") as h:
                for name in h.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    yield name, h.get_tensor(name)
        return
    flat = FlatLayout.of(config)
    for stage in range(layout.pp):
        yield from flat.as_checkpoint(stage_tensors(directory, layout, stage))


def read_flat(directory: Path, layout: FlatLayout | None = None) -> np.ndarray:
    """A checkpoint's weights as one flat float32 buffer (``models.flat`` order)."""
    layout = layout or FlatLayout.of(ModelConfig.load(directory))
    flat = np.empty(layout.numel, dtype=np.float32)
    views, seen = layout.views(flat), set()
    tensors = hf_tensors(directory)
    if layout.renames:  # fused experts: the checkpoint's tensors joined first (the whole model)
        tensors = layout.from_checkpoint(dict(tensors)).items()
    for name, t in tensors:
        if name in views:  # a tied lm_head is the embedding's slot
            views[name].copy_(t)
            seen.add(name)
    if missing := sorted(set(views) - seen):
        raise ValueError(f"{directory}: no weights for {missing[:3]}{' …' if len(missing) > 3 else ''}")
    return flat


class HFReader:
    """Hugging Face tensors by name from a checkpoint's shards, for a slice of another layout
    (``megatron_weights.hf_to_megatron`` asks in the order ``megatron_to_hf`` yields, so each
    stage is read once, holding only what was read ahead of the tensor asked for)."""

    def __init__(self, directory: Path, layout: MegatronLayout) -> None:
        self.directory, self.layout = directory, layout
        self.streams: dict[int, Iterator[tuple[str, torch.Tensor]]] = {}
        self.ahead: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        if name in self.ahead:  # the embedding may be asked twice (a tied output layer)
            return self.ahead[name] if name == "model.embed_tokens.weight" else self.ahead.pop(name)
        stage = self.layout.stage_of(name)
        if stage not in self.streams:  # fused experts come an expert at a time: joined here
            tensors = stage_tensors(self.directory, self.layout, stage)
            self.streams[stage] = joined(tensors, self.layout.config.num_experts)
        for got, t in self.streams[stage]:
            if got == name:
                if name == "model.embed_tokens.weight":
                    self.ahead[name] = t
                return t
            self.ahead[got] = t
        raise KeyError(f"{self.directory}: no tensor {name}")
