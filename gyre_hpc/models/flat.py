"""The flat weight layout: a model's parameters as one contiguous float32 buffer.

```
 ModelConfig ─▶ slots: parameter name → (offset, shape), unique parameters in registration order
                (a tied lm_head is the embedding's slot and is not listed; the names are the
                checkpoint's but for fused experts: checkpoint_tensors / from_checkpoint)

 [ embed_tokens | layers.0.input_layernorm | layers.0.self_attn.q_proj | … | norm | (lm_head) ]
   0            at₁                          at₂                            … numel
```

Engines load snapshots in it, trainers keep their parameters and gradients in it, the transport
moves it as one block and checkpoints cut it into Hugging Face tensors: every one of them asks
this module, so the layout is derived once. It knows nothing about where the buffer lives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.causal_lm import CausalLM, checkpoint_names, model_names
from gyre_hpc.models.hf_files import WEIGHTS, copy_model_files


@dataclass(frozen=True)
class FlatLayout:
    slots: dict[str, tuple[int, torch.Size]]
    """The model's parameter name → (offset, shape) in the flat buffer: a checkpoint's tensor
    names, except where transformers fuses a layer's experts into one tensor
    (``checkpoint_tensors`` names them as checkpoints do)."""
    config: ModelConfig | None = field(default=None, compare=False)

    @classmethod
    def of(cls, config: ModelConfig) -> FlatLayout:
        """Built on the meta device: no memory, no initialisation."""
        with torch.device("meta"):
            model = CausalLM(config)
        slots, at = {}, 0
        for name, p in model.named_parameters():  # tied parameters are listed once
            slots[name] = (at, p.shape)
            at += p.numel()
        return cls(slots, config)

    @cached_property
    def _meta(self) -> CausalLM:
        assert self.config is not None
        with torch.device("meta"):
            return CausalLM(self.config)

    @property
    def renames(self) -> bool:
        """Whether a checkpoint names tensors otherwise than the model does (fused experts)."""
        return self.config is not None and self.config.family.experts

    def checkpoint_tensors(self, flat: np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
        """``flat`` as a checkpoint's named tensors: views, or for fused experts copies, one
        tensor per expert (what transformers saves and SGLang loads)."""
        views = self.views(flat)
        return checkpoint_names(self._meta.hf, views) if self.renames else views

    def as_checkpoint(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Whole tensors (or ``piece``s of them) under the layout's names, one at a time, as a
        checkpoint names them (``checkpoint_tensors`` for a stream: a fused experts tensor
        becomes one tensor an expert; a piece, its expert's). Checkpoints number experts
        ``….experts.<e>.…``, as transformers saves every family gyre-hpc runs."""
        for name, t in tensors:
            base, index = whole(name)
            if not self.renames:
                yield name, t
            elif index is None:
                yield from checkpoint_names(self._meta.hf, {name: t}).items()
            else:
                for part, value in checkpoint_names(self._meta.hf, {base: t[None]}).items():
                    yield part.replace(".experts.0.", f".experts.{index}."), value

    def from_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's named tensors under the layout's names (``checkpoint_tensors`` undone)."""
        return model_names(self._meta.hf, state) if self.renames else state

    def read(self, name: str, read_checkpoint: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The layout's tensor ``name`` from a checkpoint's tensors (``read_checkpoint``, by the
        checkpoint's names): itself, or for fused experts joined from the tensors it is made of,
        which alone are read."""
        if not self.renames:
            return read_checkpoint(name)
        parts = self._parts[name]
        return self.from_checkpoint({part: read_checkpoint(part) for part in parts})[name]

    @cached_property
    def _parts(self) -> dict[str, tuple[str, ...]]:
        """Each of the layout's tensors → the checkpoint's names of it (worked out on the meta device)."""
        meta = {name: torch.empty(shape, device="meta") for name, (_, shape) in self.slots.items()}
        return {name: tuple(checkpoint_names(self._meta.hf, {name: t})) for name, t in meta.items()}

    @cached_property
    def numel(self) -> int:
        return sum(shape.numel() for _, shape in self.slots.values())

    @cached_property
    def fused(self) -> frozenset[str]:
        """The tensors a checkpoint keeps as several (a layer's experts, fused by transformers)."""
        if not self.renames:
            return frozenset()
        return frozenset(n for n, parts in self._parts.items() if len(parts) > 1)

    def pieces(self, flat: np.ndarray | torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``flat``'s tensors as views, one at a time, each fused tensor an expert at a time
        (``piece``): what a server loads, with no copy of a layer's experts made to cut them."""
        for name, view in self.views(flat).items():
            if name in self.fused:
                yield from ((piece(name, e), view[e]) for e in range(view.shape[0]))
            else:
                yield name, view

    def span(self, name: str) -> tuple[int, torch.Size]:
        """Where tensor ``name`` (or a ``piece`` of one) lies in the flat buffer: its offset and shape."""
        base, index = whole(name)
        at, shape = self.slots[base]
        if index is None:
            return at, shape
        return at + index * shape[1:].numel(), shape[1:]

    def views(self, flat: np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
        """``flat`` cut into named views (no copy)."""
        t = torch.from_numpy(flat) if isinstance(flat, np.ndarray) else flat
        if t.numel() != self.numel:
            raise ValueError(f"flat buffer holds {t.numel()} values, the layout {self.numel}")
        return {name: t[at : at + shape.numel()].view(shape) for name, (at, shape) in self.slots.items()}

    def bind(self, model: torch.nn.Module, weights: torch.Tensor, grads: torch.Tensor) -> None:
        """Make ``model``'s parameters and their gradients views of the two flat buffers, keeping
        the model's current values."""
        w, g = self.views(weights), self.views(grads)
        for name, p in model.named_parameters():
            w[name].copy_(p.detach())
            p.data = w[name]
            p.grad = g[name]

    def point(self, model: torch.nn.Module, weights: torch.Tensor, grads: torch.Tensor) -> None:
        """Make ``model``'s parameters and gradients views of the two buffers as they are (after
        the buffers moved: no values are copied)."""
        w, g = self.views(weights), self.views(grads)
        for name, p in model.named_parameters():
            p.data = w[name]
            p.grad = g[name]

    def load(self, model: torch.nn.Module, flat: np.ndarray | torch.Tensor) -> None:
        """Copy the buffer's values into ``model``'s parameters."""
        views = self.views(flat)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(views[name])

    def save(self, flat: np.ndarray, model_dir: Path, out: Path) -> Path:
        """``flat`` as a Hugging Face model directory ``out``: ``model_dir``'s config, tokenizer
        and chat template beside the weights (``model.safetensors``)."""
        copy_model_files(model_dir, out)
        self.save_weights(flat, out)
        return out

    def save_weights(self, flat: np.ndarray, out: Path) -> Path:
        """``flat`` as ``out``'s one weights file (``model.safetensors``); its path."""
        path = out / WEIGHTS
        tensors = self.checkpoint_tensors(flat)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), {"format": "pt"})
        return path


def piece(name: str, index: int) -> str:
    """The name of slice ``index`` (along the first dimension: one routed expert) of the layout's
    tensor ``name``, as a stream of whole tensors may carry a layer's fused experts, an expert at
    a time (``trainer.megatron_weights.megatron_to_hf``)."""
    return f"{name}#{index}"


def whole(name: str) -> tuple[str, int | None]:
    """A tensor's name and, for a ``piece``, its index (None for a whole tensor)."""
    base, _, index = name.partition("#")
    return base, int(index) if index else None


def joined(tensors: Iterable[tuple[str, torch.Tensor]], count: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` with each tensor that came in ``count`` pieces stacked whole again, yielded once
    its last piece arrived (holding the pieces of the tensors not yet complete, no more)."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors:
        base, index = whole(name)
        if index is None:
            yield name, t
            continue
        parts = pending.setdefault(base, {})
        parts[index] = t
        if len(parts) == count:
            yield base, torch.stack([parts[i] for i in range(count)])
            del pending[base]
