"""Log-probs of chosen tokens straight from hidden states and the output layer's weight, a chunk
of rows at a time: no [rows × vocabulary] float32 logits for a whole micro-step, forward or
backward.

```
 forward, per chunk of rows      z = (h @ Wᵀ) in float32   [chunk, V/tp]   (then dropped)
                                 lse = logsumexp z  (max and Σexp all-reduced over the TP group)
                                 log p(target) = z[target] − lse,  entropy = −Σ p·log p
 backward, per chunk (recomputed) dz = g·(onehot(target) − softmax(z))
                                 ∂h = dz @ W,  ∂W += dzᵀ @ h
```

Peak memory is a few chunks of logits, whatever the micro-step's length; the price is the
output layer's matmul once more in the backward. Only the rows asked for are computed: a trainer
passes the hidden states of the positions whose next token is a loss token. Under tensor
parallelism each rank holds a shard of the vocabulary (``first`` is its first token id) and the
reductions run over ``group``; the caller makes the hidden states whole on every rank first (and
sums their gradient back), as megatron's column-parallel output layer does. It knows nothing of
models or losses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gyre_hpc.loss.diagnostics import entropy_from_logprobs


class _Selected(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        vocab: int,
        first: int,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = hidden.shape[0]
        logp = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for a in range(0, rows, chunk):
            z = _logits(hidden[a : a + chunk], weight, vocab, first)
            t, mine = _local(targets[a : a + chunk], first, z.shape[1])
            top = z.max(-1).values
            _reduce(top, dist.ReduceOp.MAX, group)
            total = torch.exp(z - top[:, None]).sum(-1)
            _reduce(total, dist.ReduceOp.SUM, group)
            lse[a : a + chunk] = top + torch.log(total)
            picked = torch.where(mine, z.gather(-1, t[:, None])[:, 0], 0.0)
            logq = z - lse[a : a + chunk, None]  # this shard's log-softmax
            ent = -(torch.exp(logq) * torch.where(torch.isinf(z), 0.0, logq)).sum(-1)
            both = torch.stack([picked, ent])
            _reduce(both, dist.ReduceOp.SUM, group)
            logp[a : a + chunk] = both[0] - lse[a : a + chunk]
            entropy[a : a + chunk] = both[1]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.vocab, ctx.first = chunk, vocab, first
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor) -> tuple:  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk = ctx.chunk
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for a in range(0, hidden.shape[0], chunk):
            h = hidden[a : a + chunk]
            z = _logits(h, weight, ctx.vocab, ctx.first)
            t, mine = _local(targets[a : a + chunk], ctx.first, z.shape[1])
            g = grad_logp[a : a + chunk].float()
            dz = torch.exp(z - lse[a : a + chunk, None]) * -g[:, None]
            dz.scatter_add_(-1, t[:, None], torch.where(mine, g, 0.0)[:, None])
            if grad_h is not None:
                grad_h[a : a + chunk] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if ctx.needs_input_grad[1]:
                grad_w.addmm_(dz.t(), h.float())
        grad_w = grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None, None


def _logits(h: torch.Tensor, weight: torch.Tensor, vocab: int, first: int) -> torch.Tensor:
    """One chunk's float32 logits over this rank's shard; padding columns (ids ≥ ``vocab``) −inf."""
    z = (h @ weight.t()).float()
    if first + z.shape[1] > vocab:
        z[:, max(vocab - first, 0) :] = float("-inf")
    return z


def _local(targets: torch.Tensor, first: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets as column indices of this shard (0 where another shard holds them), and which it holds."""
    t = targets - first
    mine = (t >= 0) & (t < width)
    return torch.where(mine, t, 0), mine


def _reduce(x: torch.Tensor, op: Any, group: Any) -> None:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)


def selected_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk: int = 1024,
    vocab: int | None = None,
    first: int = 0,
    group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(``targets``) under the logits ``hidden @ weightᵀ`` ([M, H] and [V or V/tp, H] → [M],
    with its gradient) and each row's entropy ([M], none), ``chunk`` rows at a time. ``vocab``:
    the real vocabulary (padding columns beyond it are left out); ``first``, ``group``: this rank's
    first token id and the tensor-parallel group when ``weight`` is a shard."""
    vocab = first + weight.shape[0] if vocab is None else vocab
    if hidden.shape[0] == 0:
        zero = hidden.sum() * 0.0 + weight.sum() * 0.0  # keeps both in the graph
        return zero.expand(0).float(), torch.zeros(0, device=hidden.device)
    return _Selected.apply(hidden, weight, targets, max(int(chunk), 1), vocab, first, group)


def full_logprobs(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # the reference the chunked path is tested against
    """The unchunked rule: log-softmax over whole [M, V] logits; the target's log-prob and each
    row's entropy (no gradient)."""
    logp = torch.log_softmax(logits.float(), -1)
    return logp.gather(-1, targets[:, None])[:, 0], entropy_from_logprobs(logp.detach())
