"""Which experts a mixture-of-experts model routes each token to: read from a forward, and
imposed on one (routing replay).

```
 hidden ─▶ gate: logits ─▶ softmax ─▶ top-k ─▶ (weights, experts) ─▶ experts
                                         │ capture: the experts chosen, per layer
                                         └ replay: the given experts where known; weights are
                                           the router's own probabilities of them (renormalised
                                           as the family renormalises), so the gate still learns
```

``routed(model, replay)`` hooks the gate of every routed layer of a transformers decoder
(``CausalLM``: Qwen3-MoE, Mixtral) for the forward passes inside it. Tokens are counted as the
gate sees them, batch-major ([batch, time] flattened). A row of ``replay`` that is -1 routes
freely: a position whose route the engine never reported goes where this model sends it.

The module knows nothing about engines, trainers or the TITO log; megatron's router has its own
replay hook (``trainer.megatron_backend``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def moe_gates(model: nn.Module) -> dict[int, nn.Module]:
    """Layer index → its router, for the layers that route experts (none in a dense model)."""
    layers = model.model.layers  # type: ignore[union-attr]
    return {
        i: layer.mlp.gate
        for i, layer in enumerate(layers)
        if hasattr(layer.mlp, "experts") and hasattr(getattr(layer.mlp, "gate", None), "top_k")
    }


class Capture:
    """The experts each routed layer chose in the forward passes of one ``routed`` block."""

    def __init__(self, layers: int, top_k: int) -> None:
        self.layers, self.top_k = layers, top_k
        self.chosen: dict[int, list[torch.Tensor]] = {}

    def routes(self) -> torch.Tensor:
        """[tokens, layers, top-k] int64 over every forward of the block in order; a layer
        without experts reads 0."""
        if not self.chosen:
            return torch.zeros(0, self.layers, self.top_k, dtype=torch.int64)
        per_layer = {i: torch.cat(parts) for i, parts in self.chosen.items()}
        tokens = next(iter(per_layer.values())).shape[0]
        out = torch.zeros(tokens, self.layers, self.top_k, dtype=torch.int64)
        for i, chosen in per_layer.items():
            out[:, i] = chosen.cpu()
        return out


@contextlib.contextmanager
def routed(
    model: nn.Module, replay: torch.Tensor | None = None, renormalize: bool = True
) -> Iterator[Capture]:
    """Capture (and, with ``replay`` [tokens, layers, top-k], impose) every routed layer's
    choices during the block. ``renormalize``: the family divides its top-k weights by their
    sum (``ModelConfig.renormalizes_topk``)."""
    gates = moe_gates(model)
    layers = len(model.model.layers)  # type: ignore[union-attr]
    top_k = next((int(g.top_k) for g in gates.values()), 0)
    capture = Capture(layers, top_k)
    seen: dict[int, int] = {}  # tokens each layer has routed so far in the block

    def hook(layer: int):  # noqa: ANN202
        def after(gate: nn.Module, args: tuple, output: tuple) -> tuple | None:  # noqa: ARG001
            logits, weights, chosen = output
            if replay is not None:
                at = seen.get(layer, 0)
                given = replay[at : at + len(chosen), layer].to(chosen.device)
                if len(given) != len(chosen):
                    raise ValueError(f"replay holds {len(replay)} tokens, the forward routes more")
                chosen = torch.where(given >= 0, given, chosen)
                probs = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
                if renormalize:
                    probs = probs / probs.sum(-1, keepdim=True)
                weights = probs.to(weights.dtype)
            seen[layer] = seen.get(layer, 0) + len(chosen)
            capture.chosen.setdefault(layer, []).append(chosen.detach())
            return (logits, weights, chosen) if replay is not None else None

        return after

    handles = [gate.register_forward_hook(hook(i)) for i, gate in gates.items()]
    try:
        yield capture
    finally:
        for h in handles:
            h.remove()


def differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[tokens] True where two routings [tokens, layers, top-k] choose a different set of experts
    in at least one layer (the order of a token's k choices does not matter)."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1).any(-1)
