"""The trajectory tree of one run: a prefix tree over token ids, each unique token stored once.

```
 root ─ [system+task] ─┬─ [main calls 1..40, outputs trainable] ─┬─ … (leaf: main)
                       │                                         └─ [summary] (leaf: main-summary)
                       ├─ [compacted context + summary …] ─ …  (branch: compaction)
                       └─ [sub-agent context …] ─ …            (branch: sub-agent)
```

A record whose input extends an existing path adds only its new tokens; a divergent input
(compaction, a sub-agent's own context, a retry, several outputs for one input) branches where
it diverges; no common prefix makes a new child of the root. A position is *trainable* iff it
lies in the output of some record at exactly that position: the policy generated it in that
context. Harness tokens (system, user, tool results) are context only.

A mixture-of-experts run's nodes also keep the experts each position was routed to, once per
position as its id is: the first call that reports a position's route sets it (a later call that
re-prefilled the position at another version, or routed it otherwise, does not change it), and a
position no call reported (the last of an output, until a later call forwards it) has none.
``routes_from`` tells the proxy from which position a call's routes are still needed.

Adding a record is also how it is encoded for disk (``EncodedRecord``): the tree finds the
longest prefix the input shares with any earlier sequence of the run. To keep that linear in the
new tokens rather than in the whole context, the most recent record of each role is tried
first (one vectorised comparison), then the tree is descended from there to stay exact.

The tree knows nothing about selection, losses or files.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from gyre_hpc.trajectory.records import EncodedRecord, TitoRecord


class _Node:
    __slots__ = (
        "id",
        "parent",
        "tokens",
        "trainable",
        "logprobs",
        "versions",
        "children",
        "depth_start",
        "uid_start",
        "first_record",
        "ended",
        "n_trainable",
        "routes",
        "routed",
        "n_routed",
    )

    def __init__(
        self,
        id: int,
        parent: _Node | None,
        tokens: np.ndarray,
        depth_start: int,
        uid_start: int,
        first_record: int,
    ) -> None:
        self.id = id
        self.parent = parent
        self.tokens = tokens
        self.trainable = np.zeros(len(tokens), dtype=bool)
        self.logprobs = np.zeros(len(tokens), dtype=np.float32)
        self.versions = np.zeros(len(tokens), dtype=np.int32)
        """The policy version that generated each trainable position."""
        self.children: dict[int, _Node] = {}
        self.depth_start = depth_start
        self.uid_start = uid_start
        self.first_record = first_record
        self.ended: list[int] = []
        self.n_trainable = 0
        self.routes: np.ndarray | None = None
        """[len, layers, top-k] experts of each position (``routed`` says which hold one)."""
        self.routed = np.zeros(len(tokens), dtype=bool)
        self.n_routed = 0

    @property
    def depth_end(self) -> int:
        return self.depth_start + len(self.tokens)


@dataclass(frozen=True)
class Leaf:
    """The end of a root-to-leaf path, with the role of the record that ended it."""

    node: int
    role: str
    record: int
    length: int


@dataclass(frozen=True)
class _RecordInfo:
    call_id: str
    role: str
    input_len: int
    output_logprobs: np.ndarray
    meta: object


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if np.array_equal(a[:n], b[:n]):
        return n
    return int(np.argmax(a[:n] != b[:n]))


class TrajectoryTree:
    def __init__(self, run_id: str = "") -> None:
        self.run_id = run_id
        self.root = _Node(0, None, np.zeros(0, dtype=np.int32), 0, 0, -1)
        self.nodes: list[_Node] = [self.root]
        self.encoded: list[EncodedRecord] = []
        self.num_record_tokens = 0
        self._records: list[_RecordInfo] = []
        self._end: list[_Node] = []
        self._next_uid = 0
        self._recent: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}
        self._rebuilt: list[TitoRecord] | None = None
        """``records()`` once rebuilt, until the next record is added."""

    # ---- building ---------------------------------------------------------------------------

    @classmethod
    def from_records(cls, records: Iterable[TitoRecord]) -> TrajectoryTree:
        tree: TrajectoryTree | None = None
        for record in records:
            tree = tree or cls(record.run_id)
            tree.add(record)
        return tree or cls()

    @classmethod
    def from_encoded(cls, encoded: Iterable[EncodedRecord]) -> TrajectoryTree:
        tree: TrajectoryTree | None = None
        for enc in encoded:
            tree = tree or cls(enc.run_id)
            tree.add_encoded(enc)
        return tree or cls()

    def add(self, record: TitoRecord) -> EncodedRecord:
        """Insert one call; returns its encoding against the earlier records of the run."""
        x, out = record.input_ids, record.output_ids
        node, off = self._best_recent_point(x)
        node, off, shared = self._descend(node, off, x, node.depth_start + off)
        ref = node.first_record if shared else -1
        new_ids = x[shared:].copy()
        enc = EncodedRecord(
            self.run_id,
            len(self._records),
            record.call_id,
            record.role,
            ref,
            shared,
            new_ids,
            record.output_ids,
            record.output_logprobs,
            record.meta,
            record.routes,
            record.routes_from,
        )
        self._insert(node, off, np.concatenate([new_ids, out]), shared, len(x), enc)
        self._recent[record.role] = self._recent["*"] = (x, out, enc.index)
        return enc

    def add_encoded(self, enc: EncodedRecord) -> None:
        """Insert one call as stored on disk."""
        if enc.index != len(self._records) or not -1 <= enc.ref < enc.index:
            raise ValueError(f"record {enc.index} of run {enc.run_id} is out of order (ref {enc.ref})")
        node, off = self._locate(enc.ref, enc.shared) if enc.shared else (self.root, 0)
        tail = np.concatenate([enc.new_ids, enc.output_ids])
        self._insert(node, off, tail, enc.shared, enc.input_len, enc)

    def _best_recent_point(self, x: np.ndarray) -> tuple[_Node, int]:
        best, best_len = -1, 0
        for xc, oc, index in {id(c): c for c in self._recent.values()}.values():
            n = common_prefix(x, xc)
            if n == len(xc):
                n += common_prefix(x[n:], oc)
            if n > best_len:
                best, best_len = index, n
        return self._locate(best, best_len) if best_len else (self.root, 0)

    def _locate(self, record: int, depth: int) -> tuple[_Node, int]:
        """The point at ``depth`` on record's path, as (node, offset) with offset in (0, len]."""
        node = self._end[record]
        while node.depth_start >= depth and node.parent is not None:
            node = node.parent
        if depth > node.depth_end:
            raise ValueError(f"record {record} is shorter than {depth} tokens")
        return node, depth - node.depth_start

    def _descend(
        self, node: _Node, off: int, seq: np.ndarray, pos: int, base: int = 0
    ) -> tuple[_Node, int, int]:
        """Follow ``seq[pos-base:]`` down from (node, off); returns the point where it stops and its depth."""
        while pos - base < len(seq):
            if off < len(node.tokens):
                m = common_prefix(node.tokens[off:], seq[pos - base :])
                off, pos = off + m, pos + m
                if off < len(node.tokens):
                    break
            else:
                child = node.children.get(int(seq[pos - base]))
                if child is None:
                    break
                node, off = child, 0
        return node, off, pos

    def _insert(
        self, node: _Node, off: int, tail: np.ndarray, base: int, input_end: int, enc: EncodedRecord
    ) -> None:
        index = len(self._records)
        self._rebuilt = None
        node, off, depth = self._descend(node, off, tail, base, base)
        if off < len(node.tokens):
            node = self._split(node, off)
        if depth - base < len(tail):
            rest = tail[depth - base :]
            node = self._new_node(node, rest.copy() if depth > base else rest, index)
        node.ended.append(index)
        lp = enc.output_logprobs
        versions = enc.meta.output_versions(len(lp))
        self._mark_trainable(node, input_end, base + len(tail), lp, input_end, versions)
        if enc.routes is not None and len(enc.routes):
            self._fill_routes(node, enc.routes_from, enc.routes)
        self._records.append(_RecordInfo(enc.call_id, enc.role, input_end, lp, enc.meta))
        self._end.append(node)
        self.encoded.append(enc)
        self.num_record_tokens += base + len(tail)

    def _new_node(self, parent: _Node, tokens: np.ndarray, record: int) -> _Node:
        node = _Node(len(self.nodes), parent, tokens, parent.depth_end, self._next_uid, record)
        self._next_uid += len(tokens)
        parent.children[int(tokens[0])] = node
        self.nodes.append(node)
        return node

    def _split(self, node: _Node, off: int) -> _Node:
        """Cut ``node`` at ``off``; the new upper part is returned (the point is its end)."""
        upper = _Node(
            len(self.nodes),
            node.parent,
            node.tokens[:off],
            node.depth_start,
            node.uid_start,
            node.first_record,
        )
        upper.trainable, upper.logprobs = node.trainable[:off], node.logprobs[:off]
        upper.versions = node.versions[:off]
        upper.n_trainable = int(upper.trainable.sum())
        upper.routed = node.routed[:off]
        upper.n_routed = int(upper.routed.sum())
        if node.routes is not None:
            upper.routes, node.routes = node.routes[:off], node.routes[off:]
        node.routed = node.routed[off:]
        node.n_routed -= upper.n_routed
        assert node.parent is not None
        node.parent.children[int(node.tokens[0])] = upper
        node.tokens, node.trainable, node.logprobs, node.versions = (
            node.tokens[off:],
            node.trainable[off:],
            node.logprobs[off:],
            node.versions[off:],
        )
        node.n_trainable -= upper.n_trainable
        node.depth_start += off
        node.uid_start += off
        node.parent = upper
        upper.children[int(node.tokens[0])] = node
        self.nodes.append(upper)
        return upper

    def _mark_trainable(
        self, end: _Node, lo: int, hi: int, logprobs: np.ndarray, out_start: int, versions: np.ndarray
    ) -> None:
        """Positions [lo, hi) on the path to ``end`` were generated by ``versions`` (one per output
        position, from ``out_start``): trainable (the first log-prob and version kept)."""
        node: _Node | None = end
        while node is not None and node.depth_end > lo:
            a, b = max(lo, node.depth_start), min(hi, node.depth_end)
            if a < b:
                sl = slice(a - node.depth_start, b - node.depth_start)
                fresh = ~node.trainable[sl]
                if fresh.any():
                    node.logprobs[sl][fresh] = logprobs[a - out_start : b - out_start][fresh]
                    node.versions[sl][fresh] = versions[a - out_start : b - out_start][fresh]
                    node.trainable[sl] |= True
                    node.n_trainable += int(fresh.sum())
            node = node.parent

    def _fill_routes(self, end: _Node, lo: int, routes: np.ndarray) -> None:
        """Positions [lo, lo + len(routes)) on the path to ``end`` that have no route yet take
        ``routes``'."""
        hi = lo + len(routes)
        node: _Node | None = end
        while node is not None and node.depth_end > lo:
            a, b = max(lo, node.depth_start), min(hi, node.depth_end)
            if a < b and node.n_routed < len(node.tokens):
                sl = slice(a - node.depth_start, b - node.depth_start)
                fresh = ~node.routed[sl]
                if fresh.any():
                    if node.routes is None or node.routes.itemsize < routes.itemsize:
                        old = node.routes
                        node.routes = np.zeros((len(node.tokens), *routes.shape[1:]), routes.dtype)
                        if old is not None:
                            node.routes[:] = old
                    node.routes[sl][fresh] = routes[a - lo : b - lo][fresh]
                    node.routed[sl] |= True
                    node.n_routed += int(fresh.sum())
            node = node.parent

    def routes_from(self, input_ids: np.ndarray) -> int:
        """The first position of a call with ``input_ids`` whose route the tree does not hold:
        the engine need return routes only from there (a growing context's are held already)."""
        x = np.asarray(input_ids, dtype=np.int32)
        node, off = self._best_recent_point(x)
        node, off, shared = self._descend(node, off, x, node.depth_start + off)
        first = shared
        path: _Node | None = node
        while path is not None and path.parent is not None:
            if path.n_routed < min(len(path.tokens), shared - path.depth_start):
                gap = np.flatnonzero(~path.routed[: shared - path.depth_start])
                if len(gap):
                    first = path.depth_start + int(gap[0])
            path = path.parent
        return first

    # ---- reading ----------------------------------------------------------------------------

    def leaves(self) -> list[Leaf]:
        return [
            Leaf(n.id, self._records[n.ended[0]].role, n.ended[0], n.depth_end)
            for n in self.nodes
            if not n.children and n.ended
        ]

    def path_nodes(self, leaf: Leaf | int) -> list[_Node]:
        node: _Node | None = self.nodes[leaf.node if isinstance(leaf, Leaf) else leaf]
        path = []
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        return path[::-1]

    def path_tokens(self, leaf: Leaf | int) -> np.ndarray:
        return _concat([n.tokens for n in self.path_nodes(leaf)], np.int32)

    def path_trainable(self, leaf: Leaf | int) -> np.ndarray:
        return _concat([n.trainable for n in self.path_nodes(leaf)], bool)

    def path_logprobs(self, leaf: Leaf | int) -> np.ndarray:
        return _concat([n.logprobs for n in self.path_nodes(leaf)], np.float32)

    def path_versions(self, leaf: Leaf | int) -> np.ndarray:
        return _concat([n.versions for n in self.path_nodes(leaf)], np.int32)

    def path_routes(self, leaf: Leaf | int) -> np.ndarray | None:
        """[path, layers, top-k] int16: each position's routed experts, -1 where none is held;
        None when the run holds no routes (a dense model)."""
        nodes = self.path_nodes(leaf)
        shape = next((n.routes.shape[1:] for n in nodes if n.routes is not None), None)
        if shape is None:
            return None
        out = np.full((sum(len(n.tokens) for n in nodes), *shape), -1, dtype=np.int16)
        at = 0
        for n in nodes:
            if n.routes is not None:
                out[at : at + len(n.tokens)][n.routed] = n.routes[n.routed]
            at += len(n.tokens)
        return out

    @property
    def num_routed_positions(self) -> int:
        return sum(n.n_routed for n in self.nodes)

    def route_bytes(self) -> int:
        """Host bytes the tree's routes take."""
        return sum(n.routes.nbytes for n in self.nodes if n.routes is not None)

    def path_positions(self, leaf: Leaf | int) -> np.ndarray:
        """A unique id per tree position along the path (the same position has the same id on every path)."""
        return _concat(
            [np.arange(n.uid_start, n.uid_start + len(n.tokens)) for n in self.path_nodes(leaf)], np.int64
        )

    @property
    def record_roles(self) -> list[str]:
        return [info.role for info in self._records]

    def record_end(self, index: int) -> int:
        """The node where record ``index``'s sequence (input + output) ends."""
        return self._end[index].id

    @property
    def num_records(self) -> int:
        return len(self._records)

    @property
    def num_unique_tokens(self) -> int:
        return sum(len(n.tokens) for n in self.nodes)

    @property
    def num_trainable_tokens(self) -> int:
        return sum(n.n_trainable for n in self.nodes)

    def record(self, index: int) -> TitoRecord:
        """The exact record, rebuilt from the tree."""
        info = self._records[index]
        seq = self.path_tokens(self._end[index].id)
        return TitoRecord(
            self.run_id,
            info.call_id,
            info.role,
            seq[: info.input_len],
            seq[info.input_len :],
            info.output_logprobs,
            info.meta,
        )  # type: ignore[arg-type]

    def records(self) -> Iterator[TitoRecord]:
        """Every record, in the order they were added (rebuilt once, then kept)."""
        if self._rebuilt is None:
            self._rebuilt = [self.record(i) for i in range(len(self._records))]
        return iter(self._rebuilt)

    def relabeled(self, run_id: str) -> TrajectoryTree:
        """The same calls as another run's: the nodes are shared, so neither tree may be added
        to afterwards (a simulated run's tree, built once for every run of its shape)."""
        tree = copy.copy(self)
        tree.run_id, tree._rebuilt = run_id, None
        return tree


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)
