"""What a step's event reports of its batch: rewards, counts, tokens, engines and staleness.

Pure: it reads outcomes, micro-steps and trees and knows nothing of how they were made.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from gyre_hpc.execution.outcome import Outcome, group_rewards, mean_reward, pass_rate
from gyre_hpc.trajectory.sequences import MicroStep, StepQueue
from gyre_hpc.trajectory.tree import TrajectoryTree


def step_stats(
    outcomes: Sequence[Outcome],
    queue: StepQueue,
    runs: int,
    work: Sequence[dict[str, object]] = (),
    trees: Iterable[TrajectoryTree] = (),
) -> dict[str, object]:
    rewards = group_rewards(outcomes)
    sequences = [s for mb in queue for s in mb]
    trees = list(trees)
    return {
        "executions": len(outcomes),
        "reward_mean": mean_reward(rewards),
        "pass_rate": pass_rate(rewards),
        "dropped": len(outcomes) - len(rewards),
        "placeholders": sum(o.score.kind == "placeholder" for o in outcomes),
        "trained_runs": runs,
        "sequences": len(sequences),
        "micro_steps": len(queue),
        "tokens": sum(len(s) for s in sequences),
        "loss_tokens": int(sum(s.loss_mask.sum() for s in sequences)),
        "calls": sum(o.execution.calls for o in outcomes),
        "tool_calls": sum(o.execution.tool_calls for o in outcomes),
        "tool_errors": sum(o.execution.tool_errors for o in outcomes),
        **rollout_shape(outcomes, trees),
        "statuses": dict(sorted(Counter(o.execution.status for o in outcomes).items())),
        "groups": list(work),
        "engine_calls": engine_calls(trees),
        **prefix_reuse(trees),
    }


def rollout_shape(outcomes: Sequence[Outcome], trees: Sequence[TrajectoryTree]) -> dict[str, object]:
    """How the step's executions went: calls and generated tokens per execution, replies cut by
    ``max_tokens`` or the context, and prompt groups that carry no signal (equal rewards)."""
    generated: Counter[str] = Counter()
    replies = cut = 0
    for tree in trees:
        for r in tree.records():
            generated[r.run_id] += len(r.output_ids)
            replies += 1
            cut += r.meta.finish_reason == "length"
    groups: dict[str, list[float]] = {}
    for o in outcomes:
        if o.score.counts_in_group:
            groups.setdefault(o.execution.task_id, []).append(o.score.reward or 0.0)
    return {
        "calls_per_execution": spread([o.execution.calls for o in outcomes]),
        "tokens_per_execution": spread([generated[o.execution.run_id] for o in outcomes]),
        "sampled_tokens": sum(generated.values()),
        "replies": replies,
        "cut_replies": cut,
        "no_signal_groups": sum(len(set(r)) <= 1 for r in groups.values()),
        "group_count": len(groups),
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    """``mean``, ``p50``, ``p90`` and ``max`` of ``values`` ({} for none)."""
    if not len(values):
        return {}
    a = np.asarray(values, dtype=np.float64)
    p50, p90 = np.percentile(a, [50, 90])
    return {"mean": round(float(a.mean()), 3), "p50": float(p50), "p90": float(p90), "max": float(a.max())}


def engine_calls(trees: Iterable[TrajectoryTree]) -> dict[str, int]:
    """The runs' calls by the engine replica that served them (its URL; the last for a call
    that moved)."""
    return dict(sorted(Counter(r.meta.engine for tree in trees for r in tree.records()).items()))


def prefix_reuse(trees: Iterable[TrajectoryTree]) -> dict[str, int]:
    """The runs' input tokens, and those their engines took from a prefix cache."""
    records = [r for tree in trees for r in tree.records()]
    return {
        "input_tokens": sum(len(r.input_ids) for r in records),
        "cached_tokens": sum(r.meta.cached_tokens for r in records),
    }


def token_staleness(micro_steps: Iterable[MicroStep], trained_from: int) -> dict[str, int]:
    """Trained tokens by how many versions lie between the one that generated them and the one
    the update trains from (0: on-policy): the micro-steps an update actually trained."""
    count: Counter[int] = Counter()
    for mb in micro_steps:
        for s in mb:
            if s.versions is not None:
                lags, n = np.unique(
                    trained_from - s.versions[np.asarray(s.loss_mask) > 0], return_counts=True
                )
                count.update(dict(zip(lags.tolist(), n.tolist(), strict=True)))
    return {str(k): v for k, v in sorted(count.items())}


def staleness(trees: Iterable[TrajectoryTree], trained_from: int) -> dict[str, int]:
    """Calls by how many versions lie between the one a step trains from and the one that
    served them (0: on-policy); a call that spanned a load counts once for each version of
    its parts."""
    parts = ({v for _, v in r.meta.versions()} for tree in trees for r in tree.records())
    count = Counter(trained_from - v for versions in parts for v in versions)
    return {str(k): v for k, v in sorted(count.items())}
