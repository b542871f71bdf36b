"""Tensors a trainer hands back while its cell samples: each moved, storage and all, to a host
copy kept for the next time, and back to its device before the trainer trains.

The tensors stay the same Python objects (only ``.data`` moves), so whatever refers to them —
the model's modules, the optimizer's parameter groups and state — needs no update. Host copies
are pinned where there is a GPU, so both directions run at the bus's speed. This module does not
know what the tensors are; the trainer says which (``MegatronTrainer._resident``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def moments(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """An optimizer's state tensors by name (``adam:<key>:<parameter>``; ``names``: id of a
    parameter → its name), without its scalar step counts."""
    for p, state in optimizer.state.items():
        for key, t in state.items():
            if isinstance(t, torch.Tensor) and t.dim():
                yield f"adam:{key}:{names[id(p)]}", t


class Offload:
    """Host copies of a trainer's tensors, by name, reused from one release to the next."""

    def __init__(self) -> None:
        self.host: dict[str, torch.Tensor] = {}
        self.device: dict[str, torch.device] = {}
        self.released = False

    def release(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Move each tensor to its host copy; the bytes that left the device."""
        moved = 0
        pin = torch.cuda.is_available()
        for name, t in tensors:
            home = self.host.get(name)
            if home is None or home.shape != t.shape or home.dtype != t.dtype:
                home = self.host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            home.copy_(t.data)
            self.device[name] = t.device
            t.data = home
            moved += t.numel() * t.element_size()
        self.released = True
        return moved

    def resume(self, tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> None:
        """Each tensor back on the device it left (one made while released, such as optimizer
        state loaded then, to ``device``); the host copies stay for the next release."""
        for name, t in tensors:
            back = torch.empty(t.shape, dtype=t.dtype, device=self.device.get(name, device))
            back.copy_(t.data, non_blocking=True)
            t.data = back
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # a pinned copy may be overwritten by the next release
        self.released = False
