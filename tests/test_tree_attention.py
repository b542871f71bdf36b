"""The packed-tree attention's compiled forms: the block mask built without an [N, N] tensor,
and a bounded number of compiled lengths however many tree lengths a run sees."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from gyre_hpc.trainer.tree_attention import (
    BLOCK,
    BUCKETS,
    block_mask,
    dense_mask,
    flex,
    padded_ends,
    padded_length,
)


def forked_ends(n: int, rng: np.random.Generator) -> np.ndarray:
    """The ends of a random depth-first tree of ``n`` tokens (a prefix, then sibling branches)."""
    ends = np.empty(n, dtype=np.int64)
    stack = [(0, n)]
    while stack:
        start, stop = stack.pop()
        # A chain from start, then children that split the rest of [start, stop).
        chain = min(stop - start, int(rng.integers(1, 64)))
        ends[start : start + chain] = stop
        at = start + chain
        while at < stop:
            size = min(stop - at, int(rng.integers(1, 256)))
            stack.append((at, at + size))
            at += size
    return ends


def test_lengths_up_to_a_micro_step_take_at_most_the_bucket_count() -> None:
    limit = 65536
    lengths = {padded_length(n, limit) for n in range(1, limit + 1)}
    assert len(lengths) == BUCKETS and max(lengths) == limit
    assert all(length % BLOCK == 0 for length in lengths)
    assert all(padded_length(n, limit) >= n for n in (1, 8191, 8192, 8193, 65535, 70000))


def test_a_padded_tree_attends_as_the_tree_and_its_padding_only_to_itself() -> None:
    rng = np.random.default_rng(0)
    ends = forked_ends(300, rng)
    padded = padded_ends(ends, padded_length(300, 1024))
    full = dense_mask(padded)
    assert torch.equal(full[:300, :300], dense_mask(ends))
    assert not full[:300, 300:].any() and not full[300:, :300].any()
    assert torch.equal(full[300:, 300:], torch.eye(len(padded) - 300, dtype=torch.bool))


def test_twenty_tree_lengths_compile_the_mask_and_the_attention_a_bounded_number_of_times() -> None:
    """Forward only (FlexAttention has no CPU backward); each compiled result equals the dense
    attention of its own tree, so a reused compilation is not a stale one."""
    import torch._dynamo.utils as dynamo

    rng = np.random.default_rng(1)
    limit = 512  # four buckets of 128
    lengths = [int(n) for n in rng.choice(np.arange(40, limit), 20, replace=False)]
    before = dynamo.counters["stats"]["unique_graphs"]
    for n in lengths:
        ends = forked_ends(n, rng)
        length = padded_length(n, limit)
        mask = block_mask(padded_ends(ends, length), torch.device("cpu"))
        q, k, v = torch.randn(1, 4, length, 16), torch.randn(1, 2, length, 16), torch.randn(1, 2, length, 16)
        out = flex(q, k, v, mask)[:, :, :n]
        allowed = dense_mask(ends)
        scores = (q[:, :, :n] @ k[:, :, :n].repeat_interleave(2, 1).transpose(-1, -2)) / 4.0
        want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v[:, :, :n].repeat_interleave(
            2, 1
        )
        assert torch.allclose(out, want, atol=1e-5), n
    compiled = dynamo.counters["stats"]["unique_graphs"] - before
    buckets = len({padded_length(n, limit) for n in lengths})
    assert len(set(lengths)) == 20 and buckets <= BUCKETS
    # one graph for the mask and one for the attention per length the kernels saw
    assert compiled <= 2 * buckets, (compiled, buckets)


def test_each_length_compiles_with_and_without_grad_and_past_eight_variants_none_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Megatron's recomputation forwards a layer without grad, then again with it: two compiled
    variants a length. Five lengths make ten, past torch's default of eight, where it would
    fall back to attention that materialises the scores; here that fallback is an error, and
    none happens."""
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    for length in range(BLOCK, 6 * BLOCK, BLOCK):
        mask = block_mask(padded_ends(np.zeros(0, dtype=np.int64), length), torch.device("cpu"))
        q, k = torch.randn(1, 2, length, 16), torch.randn(1, 1, length, 16)
        with torch.no_grad():
            quiet = flex(q, k, k, mask)
        assert torch.equal(flex(q, k, k, mask), quiet)  # every token sees itself only: v
        assert torch.allclose(quiet, k.expand(1, 2, length, 16))


PEAK = """
import resource, sys, torch
from gyre_hpc.trainer.tree_attention import block_mask
import numpy as np
n = int(sys.argv[1])
ends = np.full(n, n, dtype=np.int64)
torch.compile(lambda x: x + 1)(torch.ones(1))  # the compiler's own memory, before the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mask = block_mask(ends, torch.device("cpu"))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


def test_the_block_mask_of_32k_tokens_is_built_without_an_n_squared_tensor() -> None:
    """Uncompiled, ``create_block_mask`` evaluates every [N, N] pair (10 GiB at 32K here)."""
    n = 32768
    proc = subprocess.run([sys.executable, "-c", PEAK, str(n)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak = int(proc.stdout.split()[-1])
    assert peak < n * n // 4, f"{peak / 2**20:.0f} MiB"  # a quarter of one [N, N] byte mask: 256 MiB
