"""Properties of trees, selection and the on-disk encoding over random record sets."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_hpc.trajectory import TitoRecord, TrajectoryTree, select_paths
from gyre_hpc.trajectory.codec import encode_frame, read_frames
from gyre_hpc.trajectory.records import CallMeta

ids = st.lists(st.integers(0, 4), max_size=6)  # a tiny vocabulary makes accidental sharing common


@st.composite
def record_sets(draw: st.DrawFn) -> list[TitoRecord]:
    records: list[TitoRecord] = []
    for i in range(draw(st.integers(1, 12))):
        if records and draw(st.booleans()):
            base = draw(st.sampled_from(records))
            seq = np.concatenate([base.input_ids, base.output_ids]).tolist()
            inp = seq[: draw(st.integers(0, len(seq)))] + draw(ids)
        else:
            inp = draw(ids)
        out = draw(ids)
        role = draw(st.sampled_from(["main", "main-summary", "sub-agent", "sub-agent-summary", "other"]))
        meta = CallMeta(policy_version=draw(st.integers(0, 3)), rerouted=draw(st.booleans()))
        records.append(TitoRecord("run", f"c{i}", role, inp, out, [-0.25 * j for j in range(len(out))], meta))
    return records


@settings(max_examples=200, deadline=None)
@given(record_sets(), st.integers(1, 6), st.integers(0, 2**16))
def test_masks_are_disjoint_subsets_of_trainable_positions(
    records: list[TitoRecord], jmax: int, seed: int
) -> None:
    tree = TrajectoryTree.from_records(records)
    seen: set[int] = set()
    for path in select_paths(tree, jmax=jmax, rng=random.Random(seed)):
        positions = tree.path_positions(path.leaf)
        trainable = tree.path_trainable(path.leaf)
        assert not (path.loss_mask & ~trainable).any()  # masks ⊆ trainable
        masked = set(positions[path.loss_mask].tolist())
        assert not masked & seen  # no position in two masks
        seen |= masked
    assert len(seen) <= tree.num_trainable_tokens


@settings(max_examples=200, deadline=None)
@given(record_sets())
def test_encoding_reads_back_the_exact_records(records: list[TitoRecord]) -> None:
    tree = TrajectoryTree.from_records(records)
    data = b"".join(encode_frame(e) for e in tree.encoded)
    read = read_frames(data)
    assert read.torn_bytes == 0
    rebuilt = TrajectoryTree.from_encoded(read.records)
    assert list(rebuilt.records()) == records
    assert list(tree.records()) == records
    assert rebuilt.num_unique_tokens == tree.num_unique_tokens <= tree.num_record_tokens


@settings(max_examples=100, deadline=None)
@given(record_sets())
def test_every_record_is_a_path_and_outputs_are_trainable(records: list[TitoRecord]) -> None:
    tree = TrajectoryTree.from_records(records)
    for leaf in tree.leaves():
        assert len(tree.path_tokens(leaf)) == leaf.length
    expected_trainable = set()
    for i, r in enumerate(records):
        end = tree.record_end(i)
        positions = tree.path_positions(end)
        assert tree.path_tokens(end).tolist() == r.input_ids.tolist() + r.output_ids.tolist()
        expected_trainable |= set(positions[len(r.input_ids) :].tolist())
    assert tree.num_trainable_tokens == len(expected_trainable)
