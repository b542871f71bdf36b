"""A readable outline of a trajectory tree: linear chains collapsed, branches and leaves shown.

Used by ``gyre-hpc traj show``. A chain of calls that only extend each other becomes one
segment however many calls it spans, so a run with hundreds of calls fits on a screen. Each
run's selection is the one its training made (``select_paths`` seeded by the run, as batching
seeds it), so the outline shows what was trained.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gyre_hpc.trajectory.records import EncodedRecord
from gyre_hpc.trajectory.select import SelectedPath, select_paths
from gyre_hpc.trajectory.tree import TrajectoryTree, _Node


@dataclass
class Segment:
    """A maximal single-child chain of tree nodes."""

    depth_start: int
    depth_end: int
    tokens: int
    trainable: int
    calls: Counter[str]
    leaf_role: str | None = None
    selected: list[tuple[int, int]] = field(default_factory=list)
    """(selection order, loss tokens) of the selected paths ending here."""
    children: list[Segment] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "depth": [self.depth_start, self.depth_end],
            "tokens": self.tokens,
            "trainable": self.trainable,
            "calls": dict(self.calls),
            "leaf_role": self.leaf_role,
            "selected": [{"order": o, "loss_tokens": n} for o, n in self.selected],
            "children": [c.to_dict() for c in self.children],
        }


@dataclass(frozen=True, kw_only=True)
class RunOutline:
    """One execution's tree, outlined with the paths selected from it."""

    run_id: str
    tree: TrajectoryTree
    segments: list[Segment]

    def to_dict(self) -> dict[str, Any]:
        t = self.tree
        return {
            "run": self.run_id,
            "calls": t.num_records,
            "unique_tokens": t.num_unique_tokens,
            "record_tokens": t.num_record_tokens,
            "trainable_tokens": t.num_trainable_tokens,
            "segments": [s.to_dict() for s in self.segments],
        }


def run_views(
    runs: Iterable[tuple[str, list[EncodedRecord]]], jmax: int, priority: list[str], seed: int
) -> list[RunOutline]:
    """Each run's tree from its records, outlined with the paths ``trajectory.jmax`` and
    ``trajectory.priority`` select for it under ``run.seed``."""
    views = []
    for run_id, encoded in runs:
        tree = TrajectoryTree.from_encoded(encoded)
        chosen = select_paths(tree, jmax=jmax, rng=random.Random(f"{seed}:{run_id}"), priority=priority)
        views.append(RunOutline(run_id=run_id, tree=tree, segments=outline(tree, chosen)))
    return views


def outline(tree: TrajectoryTree, selected: list[SelectedPath]) -> list[Segment]:
    picks = {p.leaf.node: [] for p in selected}
    for order, p in enumerate(selected, 1):
        picks[p.leaf.node].append((order, p.num_loss_tokens))
    return [_segment(child, picks, tree.record_roles) for child in _ordered(tree.root)]


def _segment(node: _Node, picks: dict[int, list[tuple[int, int]]], record_roles: list[str]) -> Segment:
    seg = Segment(node.depth_start, node.depth_end, 0, 0, Counter())
    while True:
        seg.tokens += len(node.tokens)
        seg.trainable += node.n_trainable
        seg.calls.update(record_roles[i] for i in node.ended)
        seg.depth_end = node.depth_end
        if len(node.children) != 1:
            break
        node = next(iter(node.children.values()))
    if not node.children and node.ended:
        seg.leaf_role = record_roles[node.ended[0]]
        seg.selected = picks.get(node.id, [])
    seg.children = [_segment(c, picks, record_roles) for c in _ordered(node)]
    return seg


def _ordered(node: _Node) -> list[_Node]:
    return sorted(node.children.values(), key=lambda c: c.first_record)
