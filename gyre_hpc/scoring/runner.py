"""The scoring rules around any scorer (partial scoring).

```
 workspace missing / NoArtifact ──────────────▶ placeholder: reward 0, counts in its group, no tokens
 score() ok ──▶ finished: scored │ timed_out/crashed: partial (scored on what it left)
 WorkspaceFault (the workspace's doing) ──────▶ scored / partial with reward 0 (why is recorded)
 EvaluationError, or any other exception ──▶ retry … up to max_retries ──▶ dropped (why is recorded)
```

Only a failure of the *scorer* is ever dropped: the built-in scorers turn everything the
workspace can make happen into a score (``scoring.session``), so the policy cannot escape a 0 by
making its evaluation fail. A scorer that raises anything else is the scorer's bug: retried,
then dropped, never allowed to stop the run.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from pathlib import Path

from gyre_hpc.errors import RecipeError
from gyre_hpc.execution.outcome import Kind, ScoreResult
from gyre_hpc.recipe.schema import ScoringConfig
from gyre_hpc.sandbox.confine import bind_paths
from gyre_hpc.scoring.contract import EvaluationError, NoArtifact, RunArtifacts, Scorer, WorkspaceFault


class ScoringRunner:
    def __init__(self, scorer: Scorer, max_retries: int, binds: tuple[Path, ...] = ()) -> None:
        self.scorer = scorer
        self.max_retries = max_retries
        self.binds = binds
        """Shown to the scorer's sandbox only (``scoring.sandbox_binds``): a verifier's own files."""

    def score(self, artifacts: RunArtifacts) -> ScoreResult:
        if self.binds:
            artifacts = replace(artifacts, sandbox=artifacts.sandbox.showing(list(self.binds)))
        attempts = 0
        if not artifacts.workspace.is_dir():
            return ScoreResult(
                run_id=artifacts.run_id,
                kind="placeholder",
                reward=0.0,
                attempts=0,
                reason=f"no workspace at {artifacts.workspace}",
            )
        errors = []
        while attempts <= self.max_retries:
            attempts += 1
            kind: Kind = "scored" if artifacts.status == "finished" else "partial"
            note = artifacts.status if kind == "partial" else ""
            try:
                reward = float(self.scorer.score(artifacts))
            except NoArtifact as err:
                return ScoreResult(
                    run_id=artifacts.run_id,
                    kind="placeholder",
                    reward=0.0,
                    attempts=attempts,
                    reason=f"no artifact: {err}",
                )
            except WorkspaceFault as err:
                return ScoreResult(
                    run_id=artifacts.run_id,
                    kind=kind,
                    reward=0.0,
                    attempts=attempts,
                    reason="; ".join(filter(None, (note, str(err)))),
                )
            except EvaluationError as err:
                errors.append(str(err))
                continue
            except Exception as err:  # noqa: BLE001 - a scorer's bug: dropped with its name, the run goes on
                errors.append(f"{type(self.scorer).__name__} raised {type(err).__name__}: {err}")
                continue
            if not 0.0 <= reward <= 1.0:
                errors.append(f"{type(self.scorer).__name__} returned {reward}, outside [0, 1]")
                continue
            return ScoreResult(
                run_id=artifacts.run_id, kind=kind, reward=reward, attempts=attempts, reason=note
            )
        return ScoreResult(
            run_id=artifacts.run_id,
            kind="dropped",
            reward=None,
            attempts=attempts,
            reason=f"evaluation failed {attempts} times: {errors[-1]}",
        )


def load_scorer(config: ScoringConfig) -> Scorer:
    """A built-in scorer by name, or ``package.module:Class`` (constructed with the config)."""
    from gyre_hpc.scoring.builtin import BUILTIN as RULES
    from gyre_hpc.scoring.harbor import HarborScorer
    from gyre_hpc.scoring.swe import SweScorer

    BUILTIN = {**RULES, "harbor": HarborScorer, "swe": SweScorer}  # the formats' own rules
    name = config.scorer
    if name in BUILTIN:
        return BUILTIN[name](config)
    module, _, attr = name.partition(":")
    if not attr:
        raise RecipeError(
            f"scoring.scorer = {name!r} is neither a built-in ({', '.join(BUILTIN)}) nor package.module:Class"
        )
    try:
        return getattr(importlib.import_module(module), attr)(config)
    except (ImportError, AttributeError) as err:
        raise RecipeError(f"scoring.scorer = {name!r} cannot be loaded: {err}") from None


class ScoringRunners:
    """One runner per scorer name, built on first use: a task may name its own scorer."""

    def __init__(self, config: ScoringConfig) -> None:
        self.config = config
        self.binds = bind_paths(config.sandbox_binds, "scoring.sandbox_binds")
        self._runners: dict[str, ScoringRunner] = {}

    def get(self, scorer: str | None) -> ScoringRunner:
        name = scorer or self.config.scorer
        if name not in self._runners:
            config = replace(self.config, scorer=name)
            self._runners[name] = ScoringRunner(load_scorer(config), config.max_retries, self.binds)
        return self._runners[name]
