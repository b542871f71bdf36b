"""Trajectory trees and Jmax selection, as a matrix of small, readable cases.

Token ids: 1-9 system/task prompt, 10-29 user and harness text, 50-59 tool results,
100+ model outputs. ``T(...)`` marks the trainable positions of a path.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from gyre_hpc.step.stats import token_staleness
from gyre_hpc.trajectory import TitoRecord, TrajectoryTree, select_paths
from gyre_hpc.trajectory.records import CallMeta
from gyre_hpc.trajectory.sequences import build_batch, group_advantages, pack_micro_steps


def rec(call: str, inp: list[int], out: list[int], role: str = "main", run: str = "r") -> TitoRecord:
    return TitoRecord(run, call, role, inp, out, [-0.1 * (i + 1) for i in range(len(out))])


def paths(tree: TrajectoryTree) -> dict[str, list[tuple[list[int], list[int]]]]:
    """role -> [(path tokens, trainable flags)] for every leaf."""
    out: dict[str, list] = {}
    for leaf in tree.leaves():
        out.setdefault(leaf.role, []).append(
            (tree.path_tokens(leaf).tolist(), tree.path_trainable(leaf).astype(int).tolist())
        )
    return out


# --- the tree -------------------------------------------------------------------------------


def test_linear_multi_turn_stores_each_token_once() -> None:
    r0 = rec("c0", [1, 2, 10], [100, 101])
    r1 = rec("c1", [1, 2, 10, 100, 101, 50], [102])
    r2 = rec("c2", [1, 2, 10, 100, 101, 50, 102, 51], [103, 104])
    tree = TrajectoryTree.from_records([r0, r1, r2])
    assert paths(tree) == {
        "main": [([1, 2, 10, 100, 101, 50, 102, 51, 103, 104], [0, 0, 0, 1, 1, 0, 1, 0, 1, 1])]
    }
    assert (tree.num_unique_tokens, tree.num_trainable_tokens, tree.num_record_tokens) == (10, 5, 5 + 7 + 10)
    assert [(e.ref, e.shared, e.new_ids.tolist()) for e in tree.encoded] == [
        (-1, 0, [1, 2, 10]),
        (0, 5, [50]),
        (1, 7, [51]),
    ]


def test_compaction_branches_and_the_summary_is_context_in_the_new_history() -> None:
    r0 = rec("c0", [1, 2, 10], [100, 101])
    r1 = rec("c1", [1, 2, 10, 100, 101, 50], [102])
    summary = rec("s", [1, 2, 10, 100, 101, 50, 102, 11], [105], role="main-summary")
    after = rec("c2", [1, 2, 10, 12, 105], [106])  # history replaced by the summary
    tree = TrajectoryTree.from_records([r0, r1, summary, after])
    assert paths(tree) == {
        "main-summary": [([1, 2, 10, 100, 101, 50, 102, 11, 105], [0, 0, 0, 1, 1, 0, 1, 0, 1])],
        "main": [([1, 2, 10, 12, 105, 106], [0, 0, 0, 0, 0, 1])],
    }
    assert tree.encoded[3].ref in (0, 1, 2) and tree.encoded[3].shared == 3


def test_sub_agent_has_its_own_context_under_the_root() -> None:
    main = rec("m0", [1, 2, 10], [100])
    sub = rec("s0", [3, 4, 20], [110], role="sub-agent")
    sub_summary = rec("s1", [3, 4, 20, 110, 52, 21], [111], role="sub-agent-summary")
    main2 = rec("m1", [1, 2, 10, 100, 53, 111], [101])  # the summary comes back as a tool result
    tree = TrajectoryTree.from_records([main, sub, sub_summary, main2])
    assert paths(tree) == {
        "sub-agent-summary": [([3, 4, 20, 110, 52, 21, 111], [0, 0, 0, 1, 0, 0, 1])],
        "main": [([1, 2, 10, 100, 53, 111, 101], [0, 0, 0, 1, 0, 0, 1])],
    }
    assert tree.encoded[1].ref == -1 and tree.encoded[1].shared == 0
    assert sorted(int(t) for t in tree.root.children) == [1, 3]


def test_retry_at_the_same_point_branches_after_the_input() -> None:
    first = rec("c0", [1, 2, 10], [100, 101])
    retry = rec("c0-retry", [1, 2, 10], [102])
    tree = TrajectoryTree.from_records([first, retry])
    assert paths(tree) == {"main": [([1, 2, 10, 100, 101], [0, 0, 0, 1, 1]), ([1, 2, 10, 102], [0, 0, 0, 1])]}
    assert (tree.encoded[1].ref, tree.encoded[1].shared, tree.encoded[1].new_ids.tolist()) == (0, 3, [])


def test_n_outputs_for_one_input_share_their_common_output_prefix() -> None:
    outs = [[100, 101], [100, 102], [100, 101]]
    tree = TrajectoryTree.from_records([rec(f"n{i}", [1, 2, 10], o) for i, o in enumerate(outs)])
    assert paths(tree) == {
        "main": [([1, 2, 10, 100, 101], [0, 0, 0, 1, 1]), ([1, 2, 10, 100, 102], [0, 0, 0, 1, 1])]
    }
    assert tree.num_unique_tokens == 6 and tree.num_trainable_tokens == 3


def test_no_common_prefix_is_a_new_child_of_the_root() -> None:
    tree = TrajectoryTree.from_records([rec("a", [1, 10], [100]), rec("b", [2, 10], [100])])
    assert len(tree.root.children) == 2 and tree.num_unique_tokens == 6


def test_output_resent_with_other_ids_is_context_not_trainable() -> None:
    """A harness that re-tokenised the model's output diverges: the new ids are context."""
    tree = TrajectoryTree.from_records(
        [rec("a", [1, 10], [100, 101]), rec("b", [1, 10, 100, 999, 50], [102])]
    )
    assert paths(tree)["main"][1] == ([1, 10, 100, 999, 50, 102], [0, 0, 1, 0, 0, 1])


# --- selection ------------------------------------------------------------------------------


def fan(n: int, trainable_prefix: bool = False) -> TrajectoryTree:
    """n retries of one call; with ``trainable_prefix`` they all extend a generated prefix."""
    records = [rec("p", [1, 10], [100, 101])] if trainable_prefix else []
    base = [1, 10, 100, 101] if trainable_prefix else [1, 10]
    records += [rec(f"r{i}", base, [110 + i] * (i + 1)) for i in range(n)]
    return TrajectoryTree.from_records(records)


def test_jmax_caps_the_number_of_paths() -> None:
    tree = fan(5)
    assert len(select_paths(tree, jmax=2, rng=random.Random(0))) == 2
    assert len(select_paths(tree, jmax=10, rng=random.Random(0))) == 5  # then nothing trainable is left


def test_role_priority_order() -> None:
    records = [
        rec("m", [1, 10], [100]),
        rec("sa", [3, 20], [110], "sub-agent"),
        rec("ms", [1, 10, 100, 11], [105], "main-summary"),
        rec("x", [5], [120], "judge"),
        rec("ss", [3, 20, 110, 21], [111], "sub-agent-summary"),
        rec("m2", [1, 10, 100, 50], [101]),
    ]
    tree = TrajectoryTree.from_records(records)
    chosen = select_paths(tree, jmax=10, rng=random.Random(0))
    assert [p.role for p in chosen] == ["main", "main-summary", "sub-agent-summary", "judge"]


def test_leaves_are_sampled_in_proportion_to_unmasked_trainable_tokens() -> None:
    tree = TrajectoryTree.from_records([rec("a", [1, 10], [100]), rec("b", [1, 10], [101, 102, 103])])
    rng = np.random.default_rng(1234)
    picks = [select_paths(tree, jmax=1, rng=rng)[0].tokens[-1] for _ in range(4000)]
    share = np.mean(np.array(picks) == 103)
    assert abs(share - 0.75) < 0.03  # 3 of 4 trainable tokens; binomial sd ≈ 0.007


def test_shared_prefix_is_trained_once() -> None:
    tree = fan(2, trainable_prefix=True)
    first, second = select_paths(tree, jmax=2, rng=random.Random(3))
    assert first.loss_mask.tolist()[:4] == [False, False, True, True]  # the generated prefix
    assert second.loss_mask.tolist()[:4] == [False, False, False, False]  # already trained
    assert first.num_loss_tokens + second.num_loss_tokens == tree.num_trainable_tokens
    assert np.all(first.logprobs[~first.loss_mask] == 0)


# --- advantages, weights, micro-steps -------------------------------------------------------


def test_group_advantages() -> None:
    assert group_advantages([1.0, 0.0, 0.5, 0.5]) == [0.5, -0.5, 0.0, 0.0]
    adv = group_advantages([1.0, 0.0], std_normalize=True)
    assert adv == pytest.approx([1.0, -1.0], rel=1e-5)


def test_two_level_mean_a_run_with_5_branches_weighs_like_a_run_with_1() -> None:
    many, one = fan(5), TrajectoryTree.from_records([rec("x", [1, 10], [100, 101, 102])])
    selected = {
        "many": select_paths(many, jmax=8, rng=random.Random(0)),
        "one": select_paths(one, jmax=8, rng=random.Random(0)),
    }
    batch = build_batch(selected, {"many": 1.0, "one": 1.0})
    assert batch.num_runs == 2
    weight = {
        run: sum(s.token_weight * s.loss_mask.sum() for s in batch.sequences if s.run_id == run)
        for run in selected
    }
    assert weight == pytest.approx({"many": 1.0, "one": 1.0})
    assert sum(1 for s in batch.sequences if s.run_id == "many") == 5


def test_pack_micro_steps_first_fit_decreasing() -> None:
    bins = pack_micro_steps([5, 3, 9, 2, 4], max_tokens=10)
    assert sorted(sorted(b) for b in bins) == [[0, 4], [1, 3], [2]]
    assert pack_micro_steps([12], max_tokens=10) == [[0]]


def test_each_trained_token_keeps_the_version_that_generated_it() -> None:
    """Calls served by versions 3 and 5: a path carries each loss token's version, and an update
    trained from version 5 sees those tokens 2 and 0 versions behind."""
    first = TitoRecord("r", "c1", "main", [1, 2], [3, 4], [-0.1, -0.2], CallMeta(policy_version=3))
    second = TitoRecord("r", "c2", "main", [1, 2, 3, 4, 9], [5, 6, 7], [-0.3] * 3, CallMeta(policy_version=5))
    tree = TrajectoryTree.from_records([first, second])
    (path,) = select_paths(tree, jmax=1, rng=random.Random(0))
    assert path.versions[path.loss_mask].tolist() == [3, 3, 5, 5, 5]
    batch = build_batch({"r": [path]}, {"r": 1.0})
    assert token_staleness([batch.sequences], trained_from=5) == {"0": 3, "2": 2}
