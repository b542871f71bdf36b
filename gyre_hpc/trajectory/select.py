"""Jmax selection: which root-to-leaf paths of a run's tree are trained, by role priority.

Repeat until ``jmax`` paths or nothing trainable is left: take the highest-priority role class
whose leaves still have unmasked trainable tokens on their paths (roles not in ``priority``
rank after it, alphabetically); pick one of its leaves with probability proportional to that
count; emit the path with ``loss_mask`` = its trainable tokens not masked yet; mask the whole
path. So a trainable token is trained at most once per run, and a shared prefix is never
counted twice. Pure: the tree is not modified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gyre_hpc.trajectory.records import ROLE_PRIORITY
from gyre_hpc.trajectory.tree import Leaf, TrajectoryTree


class Random(Protocol):
    def random(self) -> float: ...


@dataclass(frozen=True, eq=False)
class SelectedPath:
    run_id: str
    role: str
    leaf: Leaf
    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    """Behaviour log-probs where ``loss_mask`` is set (0 elsewhere)."""
    versions: np.ndarray
    """The policy version that generated each position where ``loss_mask`` is set (0 elsewhere)."""
    routes: np.ndarray | None = None
    """``TrajectoryTree.path_routes``: each position's routed experts (-1: none held)."""

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def select_paths(
    tree: TrajectoryTree, jmax: int, rng: Random, priority: Sequence[str] = ROLE_PRIORITY
) -> list[SelectedPath]:
    leaves = tree.leaves()
    rank = {role: i for i, role in enumerate(priority)}
    classes = sorted({leaf.role for leaf in leaves}, key=lambda r: (rank.get(r, len(rank)), r))
    masked: set[int] = set()
    chosen: list[SelectedPath] = []
    while len(chosen) < jmax:
        counts = _unmasked_counts(tree, masked)
        pick = None
        for role in classes:
            weights = [
                (leaf, counts[leaf.node]) for leaf in leaves if leaf.role == role and counts[leaf.node] > 0
            ]
            if weights:
                pick = _weighted(weights, rng)
                break
        if pick is None:
            break
        nodes = tree.path_nodes(pick)
        mask = np.concatenate([n.trainable & (n.id not in masked) for n in nodes])
        logprobs = np.where(mask, np.concatenate([n.logprobs for n in nodes]), np.float32(0))
        versions = np.where(mask, np.concatenate([n.versions for n in nodes]), np.int32(0))
        chosen.append(
            SelectedPath(
                tree.run_id,
                pick.role,
                pick,
                tree.path_tokens(pick),
                mask,
                logprobs,
                versions,
                tree.path_routes(pick),
            )
        )
        masked.update(n.id for n in nodes)
    return chosen


def _unmasked_counts(tree: TrajectoryTree, masked: set[int]) -> dict[int, int]:
    """Unmasked trainable tokens on the path from the root to every node."""
    counts = {tree.root.id: 0}
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            counts[child.id] = counts[node.id] + (0 if child.id in masked else child.n_trainable)
            stack.append(child)
    return counts


def _weighted(weights: list[tuple[Leaf, int]], rng: Random) -> Leaf:
    total = sum(w for _, w in weights)
    x = rng.random() * total
    for leaf, w in weights:
        x -= w
        if x < 0:
            return leaf
    return weights[-1][0]
