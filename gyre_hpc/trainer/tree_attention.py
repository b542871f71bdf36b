"""The attention of a tree packed depth-first: token ``i`` sees ``j`` iff ``j ≤ i < end[j]``.

The megatron trainer's two exact forms of the one rule, chosen by where it computes (the torch
trainer needs neither: it forwards a tree chain by chain over its ancestors' keys and values):

```
 dense   [N, N] booleans        any device, megatron's local       N² bytes: 1 GiB at 32K, 16 GiB at 128K,
                                attention (scores materialised)    + heads × N² scores per layer
 blocks  FlexAttention mask     CUDA (FlexAttention has no CPU      (N/128)² block entries: 64 Ki at 32K,
         from the same rule     backward)                           1 Mi at 128K; no N² tensor anywhere
```

The block form skips every 128 × 128 tile the rule empties (a sibling's subtree, the future)
and computes the rest fused, which is what makes 128K-token trees fit on a GPU. Both the mask
and the attention are compiled (uncompiled, ``create_block_mask`` evaluates the rule on every
[N, N] pair: 10 GiB of host memory at 32K; compiled, it stays under 100 MiB). A compiled kernel
is specialised to its length and to grad mode (megatron's recomputation runs a layer's forward
without grad, then again with it: two variants a length), and torch stops compiling after eight
variants by default, then falls back to the materialising path. So a tree is padded to one of
``BUCKETS`` lengths up to a micro-step (``padded_length``; a padding token sees only itself and
nothing sees it), and a compiled function may keep ``RECOMPILES`` variants, past which a step
fails by name instead of materialising the scores.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

BLOCK = 128
BUCKETS = 8
"""Tree lengths up to a micro-step's tokens are padded to one of this many (below torch's limit
of eight compiled lengths per function)."""


RECOMPILES = 64
"""Compiled variants a function may keep: two a length for 32 lengths, a path four micro-steps
long (a path longer than a micro-step is a micro-step of its own, padded the same way)."""


def allow_recompiles() -> None:
    """Raise torch's limit of compiled variants to ``RECOMPILES``, and fail past it (the fallback
    would materialise [heads, N, N] scores: 64-128 GiB a layer at 65,536 tokens)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILES)
    config.fail_on_recompile_limit_hit = True


def padded_length(n: int, micro_step_tokens: int) -> int:
    """The length a tree of ``n`` tokens is padded to: the next multiple of
    ``micro_step_tokens / BUCKETS`` (whole blocks), so lengths up to a micro-step take at most
    ``BUCKETS`` values (a tree past it, one path longer than a micro-step, takes more)."""
    step = max(BLOCK, -(-micro_step_tokens // BUCKETS // BLOCK) * BLOCK)
    return max(step, -(-n // step) * step)


def padded_ends(ends: np.ndarray, length: int) -> np.ndarray:
    """``ends`` of a tree padded to ``length`` tokens: each padding token ends right after itself."""
    return np.concatenate([ends, np.arange(len(ends) + 1, length + 1, dtype=ends.dtype)])


def dense_mask(ends: np.ndarray, device: torch.device | None = None) -> torch.Tensor:
    """[N, N] booleans, True where the query row attends to the key column."""
    ends = torch.from_numpy(ends).to(device)
    n = len(ends)
    q = torch.arange(n, device=device)[:, None]
    k = torch.arange(n, device=device)[None, :]
    return (k <= q) & (q < ends[None, :])


def block_mask(ends: np.ndarray, device: torch.device) -> Any:
    """FlexAttention's block-sparse form of the same rule (a ``BlockMask``), built compiled."""
    ends = torch.from_numpy(ends).to(device)

    def visible(b, h, q, k):  # noqa: ANN001, ANN202 - FlexAttention's mask_mod signature
        return (k <= q) & (q < ends[k])

    n = len(ends)
    return compiled_block_mask()(visible, None, None, n, n, device=device, BLOCK_SIZE=BLOCK)


@functools.cache
def compiled_block_mask() -> Any:
    """``create_block_mask`` compiled once per process (uncompiled it evaluates every [N, N] pair)."""
    from torch.nn.attention.flex_attention import create_block_mask

    allow_recompiles()
    return torch.compile(create_block_mask, dynamic=False)


def is_block_mask(mask: object) -> bool:
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(mask, BlockMask)


@functools.cache
def compiled_flex_attention() -> Any:
    """FlexAttention compiled once per process (uncompiled it materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    allow_recompiles()
    return torch.compile(flex_attention, dynamic=False)


def flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, scale: float | None = None
) -> torch.Tensor:
    """Attention of ``q`` [b, heads, t, d] over ``k``/``v`` [b, kv heads, t, d] under a block mask
    (``scale``: the softmax scale, 1/√d by default)."""
    groups = q.shape[1] // k.shape[1]
    return compiled_flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=groups > 1)
