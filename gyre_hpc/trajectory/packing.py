"""Tree packing: a micro-step's sequences as one sequence in which every shared prefix appears once.

```
 paths                         prefix tree                 packed (depth-first)
 A B C D E                         ┌ D E                   idx  0 1 2 3 4 5 6 7
 A B C F        ──▶   A B C ───────┼ F          ──▶        tok  A B C D E F G H
 A B G H              └ G H        ┘                       pos  0 1 2 3 4 3 2 3
                                                           end  8 8 6 5 5 6 8 8
```

Token ``i`` attends to token ``j`` iff ``j ≤ i < end[j]``: depth-first order puts a segment's
whole subtree right after it, so ``end[j]`` (where the subtree of ``j``'s segment ends) says
which later tokens descend from ``j``, and nothing else does. Positions are depths in the
path, so every token sees exactly the context, at exactly the positions, that it had in each
path it lies on: its hidden states, and the gradient every path sends through them, equal the
paths' (summed over the paths that share it).

The loss moves with the tokens as *entries* (token index, behaviour log-prob, advantage,
weight): a path's loss token becomes one entry at the packed token it lies on; the log-prob of
token ``i`` is read from the logits at ``parent[i]``, the token before it in its path. Two
runs that sampled the same prefix keep one entry each, so merging across runs loses nothing.

Pure NumPy: the trainers turn the mask into whatever their attention computes with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gyre_hpc.trajectory.sequences import TrainSequence, pack_micro_steps
from gyre_hpc.trajectory.tree import common_prefix


@dataclass(frozen=True, eq=False)
class PackedTree:
    tokens: np.ndarray
    """[N] int64: every unique (prefix, token) once, depth-first."""
    positions: np.ndarray
    """[N]: the token's index in each path it lies on."""
    parents: np.ndarray
    """[N]: the packed index of the token before it in its path; -1 for a path's first token."""
    ends: np.ndarray
    """[N]: token ``i`` sees token ``j`` iff ``j ≤ i < ends[j]``."""
    targets: np.ndarray
    """[M]: the packed token of each loss entry."""
    behaviour: np.ndarray
    """[M] float32: the behaviour log-prob of each entry's token."""
    advantages: np.ndarray
    """[M] float32."""
    weights: np.ndarray
    """[M] float32: ``1/T_run`` of the entry's run."""
    paths: int
    path_tokens: int
    """Tokens the paths would forward one by one."""
    versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """[M] int64: the version that sampled each entry's token (-1: not known)."""
    routes: np.ndarray | None = None
    """[N, layers, top-k] int16: each packed token's routed experts (-1: none known; of two
    sequences that lay the same token, the first's); None when no sequence has routes."""
    entry_paths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """[M] int64: the packed sequence (0..paths−1) each entry belongs to."""

    def __len__(self) -> int:
        return len(self.tokens)

    def chains(self) -> list[tuple[int, int]]:
        """The packed sequence cut after every leaf: ranges in which each token's parent is the
        token before it, except the first's, which is one of the tokens before the range. A
        forward of the ranges in order, each over its ancestors' keys and values, visits every
        unique token once and each (token, ancestor) pair once."""
        n = len(self.tokens)
        cuts = np.flatnonzero(self.parents[1:] != np.arange(n - 1)) + 1
        bounds = [0, *cuts.tolist(), n]
        return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]

    def ancestors(self, i: int) -> np.ndarray:
        """The packed indices token ``i`` sees before itself, in order."""
        return np.flatnonzero(self.ends[:i] > i)

    def visible(self) -> np.ndarray:
        """The dense attention mask [N, N] (True: query row attends to key column)."""
        n = len(self.tokens)
        q, k = np.arange(n)[:, None], np.arange(n)[None, :]
        return (k <= q) & (q < self.ends[None, :])


class _Segment:
    __slots__ = ("tokens", "depth", "children", "start", "end")

    def __init__(self, tokens: np.ndarray, depth: int) -> None:
        self.tokens = tokens
        self.depth = depth
        self.children: dict[int, _Segment] = {}
        self.start = self.end = 0  # packed index of its first token; of its subtree's end

    def split(self, at: int) -> None:
        """Keep ``tokens[:at]`` here; the rest becomes the only child, holding the old children."""
        tail = _Segment(self.tokens[at:], self.depth + at)
        tail.children = self.children
        self.tokens = self.tokens[:at]
        self.children = {int(tail.tokens[0]): tail}


class PrefixTrie:
    """Token sequences merged on their common prefixes; counts unique tokens as it grows."""

    def __init__(self) -> None:
        self.root = _Segment(np.zeros(0, dtype=np.int64), 0)
        self.num_tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(int(tokens[i]))
            if child is None:
                node.children[int(tokens[i])] = _Segment(tokens[i:], i)
                self.num_tokens += len(tokens) - i
                return
            n = common_prefix(child.tokens, tokens[i:])
            if n < len(child.tokens):
                child.split(n)
            node, i = child, i + n

    def chain(self, tokens: np.ndarray) -> list[_Segment]:
        """The segments an added sequence runs through, root first."""
        out, node, i = [], self.root, 0
        while i < len(tokens):
            node = node.children[int(tokens[i])]
            out.append(node)
            i += len(node.tokens)
        return out

    def layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Depth-first: tokens, positions, parents, ends; sets each segment's start and end."""
        tokens = np.empty(self.num_tokens, dtype=np.int64)
        positions = np.empty(self.num_tokens, dtype=np.int64)
        parents = np.empty(self.num_tokens, dtype=np.int64)
        ends = np.empty(self.num_tokens, dtype=np.int64)
        at = 0
        stack: list[tuple[_Segment, int, bool]] = [
            (c, -1, False) for c in reversed(self.root.children.values())
        ]
        while stack:
            seg, parent, done = stack.pop()
            if done:  # its whole subtree is placed
                seg.end = at
                ends[seg.start : seg.start + len(seg.tokens)] = at
                continue
            n = len(seg.tokens)
            seg.start = at
            tokens[at : at + n] = seg.tokens
            positions[at : at + n] = np.arange(seg.depth, seg.depth + n)
            parents[at] = parent
            parents[at + 1 : at + n] = np.arange(at, at + n - 1)
            at += n
            stack.append((seg, 0, True))
            stack += [(c, at - 1, False) for c in reversed(seg.children.values())]
        return tokens, positions, parents, ends


def pack_tree(sequences: Sequence[TrainSequence]) -> PackedTree:
    """One packed tree of the sequences (several roots if they share no first token)."""
    trie = PrefixTrie()
    arrays = [np.asarray(s.tokens, dtype=np.int64) for s in sequences]
    for a in arrays:
        trie.add(a)
    tokens, positions, parents, ends = trie.layout()
    targets, behaviour, advantages, weights, versions, owners = [], [], [], [], [], []
    shape = next((s.routes.shape[1:] for s in sequences if s.routes is not None), None)
    routes = None if shape is None else np.full((len(tokens), *shape), -1, dtype=np.int16)
    for k, (s, a) in enumerate(zip(sequences, arrays, strict=True)):
        index = np.concatenate([seg.start + np.arange(len(seg.tokens)) for seg in trie.chain(a)] or [[]])
        index = index.astype(np.int64)
        if routes is not None and s.routes is not None:
            free = (routes[index, 0, 0] < 0) & (s.routes[:, 0, 0] >= 0)
            routes[index[free]] = s.routes[free]
        loss = np.flatnonzero(np.asarray(s.loss_mask) > 0)
        targets.append(index[loss].astype(np.int64))
        behaviour.append(np.asarray(s.behaviour_logprobs, dtype=np.float32)[loss])
        advantages.append(np.full(len(loss), s.advantage, dtype=np.float32))
        weights.append(np.full(len(loss), s.token_weight, dtype=np.float32))
        versions.append(np.full(len(loss), -1) if s.versions is None else np.asarray(s.versions)[loss])
        owners.append(np.full(len(loss), k))
    cat = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)  # noqa: E731
    return PackedTree(
        tokens,
        positions,
        parents,
        ends,
        cat(targets, np.int64),
        cat(behaviour, np.float32),
        cat(advantages, np.float32),
        cat(weights, np.float32),
        len(sequences),
        sum(len(s) for s in sequences),
        cat(versions, np.int64),
        routes,
        cat(owners, np.int64),
    )


def unique_tokens(sequences: Sequence[TrainSequence]) -> int:
    """Tokens the packed tree of ``sequences`` forwards."""
    trie = PrefixTrie()
    for s in sequences:
        trie.add(np.asarray(s.tokens, dtype=np.int64))
    return trie.num_tokens


def by_run(sequences: Sequence[TrainSequence]) -> list[list[TrainSequence]]:
    """The sequences grouped by run, in order of first appearance."""
    runs: dict[str, list[TrainSequence]] = {}
    for s in sequences:
        runs.setdefault(s.run_id, []).append(s)
    return list(runs.values())


def forward_trees(sequences: Sequence[TrainSequence], block_sparse: bool) -> list[PackedTree]:
    """The trees a micro-step forwards. Under a block-sparse attention (FlexAttention on CUDA)
    one tree of all its runs, so runs also share their prompt; under a dense mask one tree per
    run, since attention over one forest would cost (Σ N)² where separate trees cost Σ N², and
    what runs share (their prompt) is little next to what a run's own paths share."""
    return [pack_tree(sequences)] if block_sparse else [pack_tree(run) for run in by_run(sequences)]


def forwarded_tokens(sequences: Sequence[TrainSequence]) -> int:
    """Tokens a micro-step forwards with one tree per run; forwarded as one forest (the torch
    trainer, megatron under block masks) runs also share their prompt, so fewer."""
    return sum(unique_tokens(run) for run in by_run(sequences))


def run_chunks(sequences: Sequence[TrainSequence], max_tokens: int) -> list[tuple[int, list[TrainSequence]]]:
    """What tree packing bins, with its unique tokens: each run's paths together, so they share
    their prefixes; a run too big for one micro-step cut, path by path, into chunks that fit."""
    chunks: list[tuple[int, list[TrainSequence]]] = []
    for run in by_run(sequences):
        trie, chunk = PrefixTrie(), []
        for s in sorted(run, key=len, reverse=True):
            before = trie.num_tokens
            trie.add(np.asarray(s.tokens, dtype=np.int64))
            if chunk and trie.num_tokens > max_tokens:
                chunks.append((before, chunk))
                trie, chunk = PrefixTrie(), []
                trie.add(np.asarray(s.tokens, dtype=np.int64))
            chunk.append(s)
        if chunk:
            chunks.append((trie.num_tokens, chunk))
    return chunks


def pack_tree_micro_steps(sequences: Sequence[TrainSequence], max_tokens: int) -> list[list[TrainSequence]]:
    """Micro-steps of at most ``max_tokens`` unique tokens: first-fit decreasing over the run
    chunks (a single path longer than ``max_tokens`` gets a micro-step of its own). Sharing
    across runs in one micro-step only makes it smaller."""
    chunks = run_chunks(sequences, max_tokens)
    bins = pack_micro_steps([size for size, _ in chunks], max_tokens)
    return [[s for i in b for s in chunks[i][1]] for b in bins]
