"""The flat weight layout: a model's parameters as one contiguous float32 buffer.

```
 Qwen3Config ─▶ slots: HF tensor name → (offset, shape), unique parameters in registration order
                (a tied lm_head is the embedding's slot and is not listed)

 [ embed_tokens | layers.0.input_layernorm | layers.0.self_attn.q_proj | … | norm | (lm_head) ]
   0            at₁                          at₂                            … numel
```

Engines load snapshots in it, trainers keep their parameters and gradients in it, the transport
moves it as one block and checkpoints cut it into Hugging Face tensors: every one of them asks
this module, so the layout is derived once. It knows nothing about where the buffer lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from gyre_hpc.models.architecture import Qwen3Config
from gyre_hpc.models.hf_files import WEIGHTS, copy_model_files
from gyre_hpc.models.qwen3 import Qwen3ForCausalLM


@dataclass(frozen=True)
class FlatLayout:
    slots: dict[str, tuple[int, torch.Size]]
    """Hugging Face tensor name → (offset, shape) in the flat buffer."""

    @classmethod
    def of(cls, config: Qwen3Config) -> FlatLayout:
        """Built on the meta device: no memory, no initialisation."""
        with torch.device("meta"):
            model = Qwen3ForCausalLM(config)
        slots, at = {}, 0
        for name, p in model.named_parameters():  # tied parameters are listed once
            slots[name] = (at, p.shape)
            at += p.numel()
        return cls(slots)

    @cached_property
    def numel(self) -> int:
        return sum(shape.numel() for _, shape in self.slots.values())

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
        save_file({k: v.contiguous() for k, v in self.views(flat).items()}, str(path), {"format": "pt"})
        return path
