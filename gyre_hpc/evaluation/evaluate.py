"""``gyre-hpc eval``: a task suite through the proxy on embedded engines of this machine, each
execution scored, the whole summarised.

```
 tasks ─▶ Dispatcher (the recipe's harness, in its sandbox) ⇄ proxy ⇄ engines (proxy.loopback)
       ─▶ scoring ─▶ outcomes ─▶ summary: pass rate, mean score, calls, tokens, seconds
```

Every execution goes through the proxy as a black-box harness's would, so its TITO log, scores and
trees land in the run directory like a training run's. It knows nothing of how its progress is
shown: it reports each dispatched and finished execution to ``on_event``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_hpc.agents.dispatch import Dispatcher, make_harness
from gyre_hpc.agents.external import Endpoint
from gyre_hpc.execution.outcome import Outcome, group_rewards, mean_reward, pass_rate
from gyre_hpc.execution.run_id import eval_run_id
from gyre_hpc.observability import events as ev
from gyre_hpc.proxy.loopback import LoopbackServing
from gyre_hpc.recipe.schema import Recipe
from gyre_hpc.rundir import RunDir
from gyre_hpc.sandbox.confine import for_run
from gyre_hpc.scoring import ScoringRunners
from gyre_hpc.tasks.task import Task


@dataclass(frozen=True, kw_only=True)
class SuiteEval:
    """One evaluation: the recipe's engines, proxy, harness and scoring, on these tasks."""

    recipe: Recipe
    model: Path
    tasks: list[Task]
    suite: str
    """The suite's name or path: its hidden tests are hidden from the executions."""
    run_dir: RunDir

    def run(
        self,
        on_event: Callable[[str, str], None] = lambda kind, run: None,
        warn: Callable[[str], None] = lambda line: None,
    ) -> dict[str, Any]:
        """Every task once; its outcomes (``executions.jsonl``) and summary written to the run
        directory; the summary."""
        outcomes = asyncio.run(self.outcomes(on_event, warn))
        summary = summarize(outcomes)
        self.run_dir.executions.write_text("".join(json.dumps(o.to_json()) + "\n" for o in outcomes))
        self.run_dir.eval_summary.write_text(json.dumps(summary, indent=1) + "\n")
        return summary

    async def outcomes(
        self, on_event: Callable[[str, str], None], warn: Callable[[str], None]
    ) -> list[Outcome]:
        """Each task once, on ``cells.count`` engines of ``cells.capacity`` calls each."""
        r, run_dir = self.recipe, self.run_dir
        sampling = {
            "temperature": r.engine.temperature,
            "top_p": r.engine.top_p,
            "max_tokens": r.engine.max_new_tokens,
        }
        runners = ScoringRunners(r.scoring)
        counters = {"dispatched": 0, "started": 0, "finished": 0}
        with ev.EventLog(run_dir.events) as events:

            def counted(kind: str, run_id: str) -> None:
                counters[kind] += 1
                d, p, f = counters.values()
                if kind == "dispatched":
                    events.emit(ev.Dispatched(run=run_id, d=d, p=p, f=f))
                elif kind == "finished":
                    events.emit(ev.Finished(run=run_id, d=d, p=p, f=f))
                on_event(kind, run_id)

            async with LoopbackServing(
                self.model, run_dir.path, r.cells.count, r.proxy, r.cells.capacity
            ) as serving:
                endpoint = Endpoint(serving.proxy_url, serving.key, self.model.name, serving.proxy.usage)
                sandbox = for_run(
                    r.agent, run_dir.path, self.suite, warn, scoring_binds=r.scoring.sandbox_binds
                )
                logs = run_dir.execution_logs
                harness = make_harness(r.agent, endpoint, sampling, r.run.seed, logs, sandbox)
                dispatcher = Dispatcher(
                    harness,
                    lambda task: runners.get(task.scorer),
                    run_dir.workspaces,
                    run_dir.task_files,
                    r.cells.count * r.cells.capacity,
                    counted,
                )
                return await dispatcher.run_all([(eval_run_id(t.id), t) for t in self.tasks])


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Pass rate and mean score (of the outcomes that count), how each was scored and ended,
    and the calls, tokens and seconds of an execution on average."""
    rewards = group_rewards(outcomes)
    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[o.score.kind] = kinds.get(o.score.kind, 0) + 1
    n = max(len(outcomes), 1)
    return {
        "tasks": len(outcomes),
        "pass_rate": pass_rate(rewards),
        "mean_score": mean_reward(rewards),
        "scoring": ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())),
        "statuses": ", ".join(
            f"{s} {sum(1 for o in outcomes if o.execution.status == s)}"
            for s in sorted({o.execution.status for o in outcomes})
        ),
        "calls_per_execution": sum(o.execution.calls for o in outcomes) / n,
        "tokens_per_execution": sum(o.execution.tokens for o in outcomes) / n,
        "seconds_per_execution": sum(o.execution.seconds for o in outcomes) / n,
    }
